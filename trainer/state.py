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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from resilient.errors import StateError
from resilient.rng import capture_rng_state, restore_rng_state
from resilient.state import flatten_state, held_elsewhere, placeholder
from resilient.trainer.data import OmniPipeline
from resilient.trainer.schedule import load_scheduler_state, scheduler_state

if TYPE_CHECKING:
    from resilient.trainer.pipeline_parallel import Stages


@dataclass(slots=True)
class TrainingParts:
    """The stateful pieces of a run, as the checkpoint sees them."""

    model: nn.Module
    """The rank model: the whole model, or under pipelining the part this rank's stages run (its
    parameters under their global names; the optimizer and the checkpoint go through it)."""
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    data: OmniPipeline
    """The data pipeline (``trainer/data``; pipeline parallelism is ``stages``)."""
    stages: Stages | None = None
    """Under pipelining, this rank's stages and their schedule (what a step calls instead of the model)."""
    global_params: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    """Under pipelining, every parameter of the whole model (in its order): global shape and dtype
    by name; empty without pipelining (``model`` then holds them all)."""


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict`` of ``model`` and ``optimizer``, sharing their tensors, with an optimizer
    that had no state left as a fresh one trains.

    On such an optimizer ``get_state_dict`` materializes the moments (what a load needs as its
    target) by a zero-lr step on zero gradients, which also counts a step: AdamW's ``step`` became 1,
    so the first real update took Adam's bias correction for step 2, and a fresh run trained
    differently with ``checkpoint.resume`` on (its restore target is built before step 1) than off.
    The counters go back to 0; the moments that step left are zeros, as a fresh optimizer's are.
    """
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer)
    if fresh:
        numbers = False
        for per_param in optimizer.state.values():
            step = per_param.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()  # in place: the state dict holds this very tensor
            elif step is not None:
                per_param["step"], numbers = 0, True
        if numbers:  # a number is not shared with the state dict: take it again
            model_state, optim_state = get_state_dict(model, optimizer)
    return model_state, optim_state


def capture_state(parts: TrainingParts, step: int, tokens_seen: int) -> dict[str, Any]:
    """The nested state to hand to ``Checkpointer.save`` (or to ``load`` as the target); on a
    fresh optimizer it materializes the moments without counting a step (``state_dicts``).

    Under pipelining every rank names every parameter: those of other stages as placeholders
    (``resilient.state.held_elsewhere``), so the checkpoint's keys, global shapes and optimizer
    param group are the same whatever the stage split, and any split loads them.
    """
    model_state, optim_state = state_dicts(parts.model, parts.optimizer)
    if parts.global_params:
        _name_other_stages(model_state, optim_state, parts.global_params)
    return {
        "model": model_state,
        "optim": optim_state,
        "scheduler": scheduler_state(parts.scheduler),
        "data": parts.data.state_dict(),
        "rng": capture_rng_state(),
        "train": {"step": step, "tokens_seen": tokens_seen},
    }


def _name_other_stages(
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
    global_params: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> None:
    # Every parameter has the same optimizer state keys (AdamW: step, exp_avg, exp_avg_sq): a local
    # entry is the template for the others' (a rank always holds at least one block).
    template = next(iter(optim_state["state"].values()))
    for name, (shape, dtype) in global_params.items():
        if name in model_state:
            continue
        model_state[name] = placeholder(shape, dtype)
        optim_state["state"][name] = {
            key: placeholder(() if value.dim() == 0 else shape, value.dtype) for key, value in template.items()
        }
    # One param group holding every parameter, in the whole model's order: the value a run
    # without pipelining saves, the same on every rank. (Several groups would need each group's
    # global members: build_optimizer makes one.)
    groups = optim_state["param_groups"]
    if len(groups) != 1:
        raise StateError(
            f"pipelined checkpoints support one optimizer param group, the optimizer has {len(groups)}: "
            "build it over the rank model's parameters as one group (trainer/schedule.build_optimizer), "
            "or train with parallel.pp=1"
        )
    groups[0]["params"] = list(global_params)


@torch.no_grad()
def copy_model_and_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, source: nn.Module, source_optimizer: torch.optim.Optimizer
) -> None:
    """Copy every tensor of ``source``'s parameters and ``source_optimizer``'s state (built the same
    way, on the same mesh) into ``model``'s and ``optimizer``'s, in place: the tensors a restore
    target shares (``capture_state``) keep their storage. An optimizer whose state is not there yet
    gets it as a restore target does (``state_dicts``), on both sides alike."""
    into, source_tensors = _local_tensors(model, optimizer), _local_tensors(source, source_optimizer)
    if into.keys() != source_tensors.keys():
        differ = sorted(into.keys() ^ source_tensors.keys())[:3]
        raise StateError(f"the rebuilt model and optimizer name other tensors than the live ones (e.g. {differ})")
    for fqn, tensor in into.items():
        tensor.copy_(source_tensors[fqn])


def _local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's own tensors of ``model`` and ``optimizer`` by state FQN (a DTensor's local shard)."""
    model_state, optim_state = state_dicts(model, optimizer)
    leaves = flatten_state({"model": model_state, "optim": optim_state})
    tensors = {fqn: leaf.value for fqn, leaf in leaves.items() if leaf.is_tensor}
    return {fqn: t.to_local() if isinstance(t, DTensor) else t for fqn, t in tensors.items()}


def apply_state(parts: TrainingParts, state: dict[str, Any]) -> tuple[int, int]:
    """Put a loaded state (filled in place by ``Checkpointer.load``) into the live objects.

    Returns (step, tokens_seen). The data state's fingerprint is checked by the pipeline: a
    checkpoint of another data stream raises RestoreError instead of resuming on wrong data.
    Placeholders of other pipeline stages are dropped, and the param group keeps only this rank's
    parameters.
    """
    local = {name for name, _ in parts.model.named_parameters()}
    model_state = {k: v for k, v in state["model"].items() if not held_elsewhere(v)}
    optim = state["optim"]
    optim_state = {
        "state": {k: v for k, v in optim["state"].items() if k in local},
        "param_groups": [{**g, "params": [n for n in g["params"] if n in local]} for g in optim["param_groups"]],
    }
    set_state_dict(parts.model, parts.optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    load_scheduler_state(parts.scheduler, state["scheduler"])
    parts.data.load_state_dict(state["data"])
    restore_rng_state(state["rng"])
    return int(state["train"]["step"]), int(state["train"]["tokens_seen"])
