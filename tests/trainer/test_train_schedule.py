"""trainer/schedule.py: warmup + cosine, and the scheduler state as JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch

from resilient.trainer.config import OptimConfig
from resilient.trainer.schedule import (
    build_optimizer,
    build_scheduler,
    load_scheduler_state,
    lr_multiplier,
    scheduler_state,
)

pytestmark = pytest.mark.timeout(60)


def test_warmup_then_cosine_to_the_floor() -> None:
    f = lr_multiplier(warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert f(14) == pytest.approx(0.1)
    assert f(1000) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))


def test_no_warmup_starts_at_peak() -> None:
    f = lr_multiplier(warmup_steps=0, decay_steps=10, min_lr_ratio=0.0)
    assert f(0) == 1.0
    assert f(5) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_scheduler_state_is_json_and_resumes_the_schedule() -> None:
    config = OptimConfig(lr=1e-2, warmup_steps=3, decay_steps=0)

    def fresh():
        model = torch.nn.Linear(4, 4)
        optimizer = build_optimizer(model, config)
        return model, optimizer, build_scheduler(optimizer, config, decay_steps=10)

    _, optimizer, scheduler = fresh()
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    state = json.loads(json.dumps(scheduler_state(scheduler)))
    assert "lr_lambdas" not in state

    _, optimizer2, scheduler2 = fresh()
    for _ in range(3):
        optimizer2.step()
        scheduler2.step()
    saved = json.loads(json.dumps(scheduler_state(scheduler2)))
    saved_lr = optimizer2.param_groups[0]["lr"]
    _, optimizer3, scheduler3 = fresh()
    load_scheduler_state(scheduler3, saved)
    optimizer3.param_groups[0]["lr"] = saved_lr  # the optimizer's own state carries its lr
    resumed = []
    for _ in range(3):
        resumed.append(optimizer3.param_groups[0]["lr"])
        optimizer3.step()
        scheduler3.step()
    assert resumed == lrs[3:]
