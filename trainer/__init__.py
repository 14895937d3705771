"""resilient.trainer: the omni model, its parallelization, its data pipeline and the training loop.

Entry point: ``torchrun --nproc-per-node N -m resilient.trainer --config configs/tiny.toml --set k=v``
(or ``resilient-train --nproc N ...``). Modules: ``config`` (TOML recipe -> validated sections),
``build`` (device, mesh, model, optimizer, data, checkpointer), ``loop`` (``Trainer``: resume, step,
save, step hooks), ``sync`` (the step-sync seam: ``StepSync``, ``LocalSync``), ``replicated``
(``ReplicatedTrainer``: a replica group under a torchft quorum), ``state`` (what a checkpoint holds),
``schedule`` (AdamW, warmup + cosine), ``outputs`` (metrics.jsonl, samples.jsonl), ``train`` (the
entry point of one rank), ``launch`` (what ``resilient-train`` starts: torchrun, lighthouse, groups);
``model/``, ``parallelize`` and ``data/`` are the components the loop drives.
"""
