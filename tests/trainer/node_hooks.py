"""A step hook for the multi-node tests: what each rank was told about its node."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

NODE_ENV = ("RESILIENT_NODE_ID", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def record_node(trainer):
    """Each rank writes its node environment to ``<run.dir>/node-group<G>-rank<r>.json`` once, at start."""
    group = os.environ.get("RESILIENT_GROUP", "0")
    path = os.path.join(trainer.config.run.dir, f"node-group{group}-rank{dist.get_rank()}.json")
    with open(path, "w") as f:
        json.dump({name: os.environ.get(name) for name in NODE_ENV}, f)
    return lambda step, trainer: None
