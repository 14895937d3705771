"""Watching a run: the step-time breakdown (``timing``), straggler localization (``straggler``,
``observe``), hang detection (``watchdog``), peak FLOP/s for MFU (``peak``), the run's output files
(``outputs``) and the one-line operator reports of the ranks (``quiet``)."""
