"""Building a run's pieces from its config: device, mesh, model, optimizer, data, checkpointer;
and the step-0 model and optimizer again, into the live ones (``reinitialize``)."""

from __future__ import annotations

import dataclasses
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
from resilient.rng import capture_rng_state, restore_rng_state
from resilient.storage.checkpointer import Checkpointer
from resilient.trainer.config import TrainConfig
from resilient.trainer.data import OmniPipeline
from resilient.trainer.model import OmniModel
from resilient.trainer.parallelize import build_mesh, parallelize_model, stage_mesh
from resilient.trainer.pipeline_parallel import OmniStage, Stages, prune_to_stages, rank_stages, stage_layers
from resilient.trainer.schedule import build_optimizer, build_scheduler
from resilient.trainer.state import TrainingParts, copy_model_and_optimizer

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
    if p.world_size != world_size:
        raise ConfigError(
            f"parallel.pp={p.pp} x parallel.dp_shard={p.dp_shard} x parallel.tp={p.tp} = {p.world_size} ranks, "
            f"but {world_size} were started: launch {p.world_size} ranks (--nproc-per-node) or set "
            f"--set parallel.pp=... --set parallel.dp_shard=... --set parallel.tp=... so that their product "
            f"is {world_size}"
        )


def seed_everything(seed: int) -> None:
    # Same seed on every rank: tensor-parallel ranks must draw identical random numbers (dropout,
    # noise) for the activations they share. The model's init does not use these RNGs at all.
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def build_parts(config: TrainConfig, device: torch.device) -> tuple[DeviceMesh, TrainingParts]:
    """Mesh, parallelized model (and pipeline stages), optimizer, scheduler and this rank's data."""
    p = config.parallel
    mesh = build_mesh(p.dp_shard, p.tp, device.type, pp=p.pp)
    model, stages, global_params = build_model(config, mesh, device)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.decay_steps)
    # Data-parallel rank = dp_shard coordinate: tensor-parallel and pipeline peers share their batch.
    data = OmniPipeline(config.data.pipeline, share=mesh["dp_shard"].get_local_rank(), num_shares=p.dp_shard)
    parts = TrainingParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        stages=stages,
        global_params=global_params,
    )
    return mesh, parts


def build_model(
    config: TrainConfig, mesh: DeviceMesh, device: torch.device
) -> tuple[OmniModel, Stages | None, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The step-0 rank model on ``mesh``, parallelized (under pipelining: cut to this rank's stages,
    with their schedule and every parameter's global shape and dtype; else None and {})."""
    # Same seed on every rank: each rank cuts its shards from an identical full model, no broadcast.
    # Under pipelining the whole model is built on the CPU and only this rank's stages go to the
    # device: a GPU never holds the other stages.
    model = OmniModel(config.model, seed=config.run.seed)
    if config.parallel.pp > 1:
        stages, global_params = build_stages(config, model, mesh, device)
        return model, stages, global_params
    parallelize_model(model.to(device), mesh, config.parallel)
    return model, None, {}


def reinitialize(config: TrainConfig, mesh: DeviceMesh, device: torch.device, parts: TrainingParts) -> None:
    """Put the step-0 model and optimizer state back into ``parts``, in place: what a fresh start
    trains from after a RAM restore wrote a step into them and no step was restored after all
    (``recovery.restore``'s ``reinit``). Deterministic from ``run.seed``: the model is built again
    on ``mesh`` (its init reads no global RNG) with a fresh optimizer, whose state comes as the live
    one's came when ``capture_state`` built the restore target; both are copied into the live
    tensors. The global RNGs, the scheduler and the data cursor are left as they are (a RAM restore
    writes only tensors before every rank agreed)."""
    rng = capture_rng_state()
    try:  # building modules draws from the global RNG (their default init, then overwritten)
        model, _, _ = build_model(config, mesh, device)
    finally:
        restore_rng_state(rng)
    copy_model_and_optimizer(parts.model, parts.optimizer, model, build_optimizer(model, config.optim))


def build_stages(
    config: TrainConfig, model: OmniModel, mesh: DeviceMesh, device: torch.device
) -> tuple[Stages, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Cut ``model`` (in place) down to this rank's pipeline stages, parallelize each on the
    rank's ``dp_shard x tp`` mesh, and build the schedule; also returns the global shape and dtype of
    every parameter of the whole model (the checkpoint names them all on every rank)."""
    p, data = config.parallel, config.data.pipeline
    layers = stage_layers(config.model.n_layers, p.num_stages)
    indices = rank_stages(p, mesh["pp"].get_local_rank())
    global_params = {name: (tuple(t.shape), t.dtype) for name, t in model.named_parameters()}
    prune_to_stages(model, layers, indices)
    model.to(device)
    stages = [OmniStage(model, layers[i], first=i == 0, last=i == p.num_stages - 1) for i in indices]
    for stage in stages:
        parallelize_model(stage, stage_mesh(mesh), p)
    dtype = torch.bfloat16 if p.mixed_precision == "bf16" else config.model.torch_dtype
    # Under sequence parallelism each tp rank hands on its slice of the sequence.
    length = data.row_len // (p.tp if p.sequence_parallel else 1)
    runner = Stages(
        stages,
        indices,
        p,
        group=mesh["pp"].get_group(),
        device=device,
        boundary=(length, config.model.dim),
        boundary_dtype=dtype,
    )
    return runner, global_params


def build_checkpointer(config: TrainConfig, saves_log: str | None) -> Checkpointer:
    """The run's Checkpointer; ``saves_log``: where this rank appends its SaveStats (None: nowhere)."""
    storage = dataclasses.replace(config.checkpoint.storage, metrics_path=saves_log)
    return Checkpointer(config.checkpoint.url, config=storage)


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
