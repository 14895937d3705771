"""A step hook for the end-to-end tests, loaded by the trainer through ``run.step_hooks``."""

from __future__ import annotations

import os

import torch.distributed as dist


def record_steps(trainer):
    """Each rank appends '<step> <data cursor>' to ``<run.dir>/hook-rank<r>.txt`` after every step."""
    path = os.path.join(trainer.config.run.dir, f"hook-rank{dist.get_rank()}.txt")

    def hook(step, trainer):
        cursor = trainer.parts.data.cursor
        with open(path, "a") as f:
            f.write(f"{step} {cursor.epoch}:{cursor.row}\n")

    return hook
