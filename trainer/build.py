"""Building a run's pieces from its config: device, mesh, model, optimizer, data, checkpointer."""

from __future__ import annotations

import importlib
import logging
import os
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from resilient.errors import ConfigError
from resilient.storage.checkpointer import Checkpointer
from resilient.storage.config import CheckpointerConfig
from resilient.trainer.config import TrainConfig
from resilient.trainer.data import OmniPipeline
from resilient.trainer.model import OmniModel
from resilient.trainer.parallelize import build_mesh, parallelize_model
from resilient.trainer.schedule import build_optimizer, build_scheduler
from resilient.trainer.state import TrainingParts

if TYPE_CHECKING:
    from resilient.trainer.loop import Trainer

log = logging.getLogger(__name__)

StepHook = Callable[[int, "Trainer"], None]
"""Called on every rank with (step, trainer) after each committed step."""


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("run.device='cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_world_size(config: TrainConfig, world_size: int) -> None:
    """Fail before any collective when the launcher started a different number of ranks."""
    p = config.parallel
    if p.dp_shard * p.tp != world_size:
        raise ConfigError(
            f"parallel.dp_shard={p.dp_shard} x parallel.tp={p.tp} = {p.dp_shard * p.tp} ranks, but "
            f"{world_size} were started: launch {p.dp_shard * p.tp} ranks (--nproc-per-node) or set "
            f"--set parallel.dp_shard=... --set parallel.tp=... so that their product is {world_size}"
        )


def seed_everything(seed: int) -> None:
    # Same seed on every rank: tensor-parallel ranks must draw identical random numbers (dropout,
    # noise) for the activations they share. The model's init does not use these RNGs at all.
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def build_parts(config: TrainConfig, device: torch.device) -> tuple[DeviceMesh, TrainingParts]:
    """Mesh, parallelized model, optimizer, scheduler and this rank's data pipeline."""
    mesh = build_mesh(config.parallel.dp_shard, config.parallel.tp, device.type)
    # Same seed on every rank: each rank cuts its shards from an identical full model, no broadcast.
    model = OmniModel(config.model, seed=config.run.seed).to(device)
    parallelize_model(model, mesh, config.parallel)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.decay_steps)
    # Data-parallel rank = dp_shard coordinate: tensor-parallel peers share their batch.
    pipeline = OmniPipeline(
        config.data.pipeline, share=mesh["dp_shard"].get_local_rank(), num_shares=config.parallel.dp_shard
    )
    return mesh, TrainingParts(model=model, optimizer=optimizer, scheduler=scheduler, pipeline=pipeline)


def build_checkpointer(config: TrainConfig, saves_log: str | None) -> Checkpointer:
    """The run's Checkpointer; ``saves_log``: where this rank appends its SaveStats (None: nowhere)."""
    ckpt = config.checkpoint
    return Checkpointer(
        ckpt.url,
        config=CheckpointerConfig(
            keep_last=ckpt.keep_last or None,
            writer=ckpt.writer,
            if_busy=ckpt.if_busy,
            commit_timeout_s=ckpt.timeout_s,
            close_timeout_s=ckpt.timeout_s,
            metrics_path=saves_log,
        ),
    )


def load_step_hooks(paths: list[str], trainer: Trainer) -> list[StepHook]:
    """Hooks named by 'package.module:factory' paths; factory(trainer) returns a hook or None."""
    hooks = []
    for path in paths:
        module_name, _, attr = path.partition(":")
        try:
            factory: Any = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"run.step_hooks entry {path!r} cannot be imported: {e}") from e
        hook = factory(trainer)
        if hook is not None:
            hooks.append(hook)
    return hooks
