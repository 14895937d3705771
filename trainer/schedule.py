"""Optimizer and learning-rate schedule: AdamW, linear warmup, cosine decay to a floor.

The schedule is a closure (a plain function), so ``LambdaLR.state_dict()`` stores ``None`` for it
and the checkpoint holds only counters: the shape of the schedule always comes from the config of
the run that loads it, and the state is plain JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from resilient.trainer.config import OptimConfig


def lr_multiplier(warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr for the optimizer step that follows ``done`` completed steps.

    Warmup: (done + 1) / warmup_steps, so the first step already trains (a 0 lr step would only
    advance Adam's bias correction). Then a half cosine from 1 at step ``warmup_steps`` to
    ``min_lr_ratio`` at ``decay_steps`` (Loshchilov & Hutter 2017, SGDR, without restarts), flat after.
    """

    def multiplier(done: int) -> float:
        if done < warmup_steps:
            return (done + 1) / warmup_steps
        span = max(1, decay_steps - warmup_steps)
        progress = min(1.0, (done - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=(config.betas[0], config.betas[1]),
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, decay_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lr_multiplier(config.warmup_steps, decay_steps, config.min_lr_ratio))


def scheduler_state(scheduler: LambdaLR) -> dict:
    """The scheduler's counters as JSON (its lambda is code, rebuilt from the config)."""
    state = scheduler.state_dict()
    state.pop("lr_lambdas", None)
    return state


def load_scheduler_state(scheduler: LambdaLR, state: dict) -> None:
    scheduler.load_state_dict({**state, "lr_lambdas": [None] * len(scheduler.lr_lambdas)})
