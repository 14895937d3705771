"""Launching a job: the replica-group launcher (``launch``), the lighthouse it starts and restarts
(``lighthouse``), several launchers as the nodes of one job (``multinode``), and the SLURM and
Kubernetes files that start them on a cluster (``emit``)."""
