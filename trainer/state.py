"""The checkpointed training state: what a step's checkpoint holds, and how it goes back in place.

Layout (FQNs as stored; tensors are zarr arrays in global shape, the rest JSON in the manifest):

=================================  ==========================================================
``model.<param fqn>``              parameters (DTensors; any mesh loads them)
``optim.state.<param fqn>.*``      AdamW ``exp_avg``, ``exp_avg_sq`` (DTensors) and ``step``
``optim.param_groups``             JSON: lr, betas, weight decay, ... per group, params by FQN
``scheduler``                      JSON: LambdaLR counters (the schedule's shape is config)
``data``                           JSON: {version, fingerprint, seed, epoch, rows_consumed}
``rng``                            JSON per rank: torch / python / numpy RNG states
``train``                          JSON: {step, tokens_seen}
=================================  ==========================================================

``step`` of a checkpoint = optimizer steps applied = global batches consumed: its data cursor
points at the first batch the next step trains on, so a resume neither repeats nor skips one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim.lr_scheduler import LambdaLR

from resilient.rng import capture_rng_state, restore_rng_state
from resilient.trainer.data import OmniPipeline
from resilient.trainer.schedule import load_scheduler_state, scheduler_state


@dataclass(slots=True)
class TrainingParts:
    """The stateful pieces of a run, as the checkpoint sees them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    pipeline: OmniPipeline


def capture_state(parts: TrainingParts, step: int, tokens_seen: int) -> dict[str, Any]:
    """The nested state to hand to ``Checkpointer.save`` (or to ``load`` as the target).

    ``get_state_dict`` materializes the optimizer's moments on a fresh optimizer (a zero-lr step
    on zero gradients), which is what a load needs as a target; a fresh run never calls this before
    its first real step, so its Adam step counter is not shifted by that initialization.
    """
    model_state, optim_state = get_state_dict(parts.model, parts.optimizer)
    return {
        "model": model_state,
        "optim": optim_state,
        "scheduler": scheduler_state(parts.scheduler),
        "data": parts.pipeline.state_dict(),
        "rng": capture_rng_state(),
        "train": {"step": step, "tokens_seen": tokens_seen},
    }


def apply_state(parts: TrainingParts, state: dict[str, Any]) -> tuple[int, int]:
    """Put a loaded state (filled in place by ``Checkpointer.load``) into the live objects.

    Returns (step, tokens_seen). The data state's fingerprint is checked by the pipeline: a
    checkpoint of another data stream raises RestoreError instead of resuming on wrong data.
    """
    set_state_dict(parts.model, parts.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_scheduler_state(parts.scheduler, state["scheduler"])
    parts.pipeline.load_state_dict(state["data"])
    restore_rng_state(state["rng"])
    return int(state["train"]["step"]), int(state["train"]["tokens_seen"])
