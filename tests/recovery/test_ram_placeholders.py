"""Pipeline placeholders in the RAM tier (``recovery/snapshot_format.py`` ``local_tensors``): another
stage's parameter holds no bytes on this rank, so a snapshot leaves it out, and a restore leaves
it a placeholder while the rank's own tensors come back."""

from __future__ import annotations

import pytest
import torch

from resilient.recovery.snapshot_format import json_values, layout_tensors, local_tensors
from resilient.state import flatten_state, held_elsewhere, placeholder
from tests.recovery.ram import workers

pytestmark = pytest.mark.timeout(30)


def _stage_state(step: int) -> dict:
    """Stage 0 of two: "model.w0" and its optimizer state are here, "model.w1" (stage 1's) is not."""
    return {
        "model": {"w0": torch.arange(12.0).reshape(3, 4) + step, "w1": placeholder((5, 7), torch.bfloat16)},
        "optim": {
            "w0": {"exp_avg": torch.full((3, 4), float(step)).bfloat16()},
            "w1": {"exp_avg": placeholder((5, 7), torch.bfloat16)},
        },
        "train": {"step": step},
    }


def test_a_snapshot_layout_leaves_placeholders_out():
    leaves = flatten_state(_stage_state(3))
    tensors = local_tensors(leaves)
    assert list(tensors) == ["model.w0", "optim.w0.exp_avg"]
    assert torch.equal(tensors["model.w0"], torch.arange(12.0).reshape(3, 4) + 3)
    entries, nbytes = layout_tensors(tensors)
    assert [(e.fqn, e.dtype, e.shape, e.offset, e.nbytes) for e in entries] == [
        ("model.w0", "float32", [3, 4], 0, 48),
        ("optim.w0.exp_avg", "bfloat16", [3, 4], 64, 24),  # 64-byte aligned, after w0's 48 bytes
    ]
    assert nbytes == 128  # nothing is reserved for the 2 x 5 x 7 bf16 placeholders
    assert json_values(leaves) == {"train": {"step": 3}}


def test_a_ram_snapshot_restores_a_stage_and_its_placeholders_stay_meta(tmp_path):
    store_dir = str(tmp_path / "store")
    ram = workers.tier(0, 1, store_dir)  # one process, no process group
    try:
        assert ram.snapshot(5, _stage_state(5)) is True
        ram.wait(20)
        index = ram.own.indexes()[5]
        assert [e.fqn for e in index.tensors] == ["model.w0", "optim.w0.exp_avg"]
    finally:
        ram.close()

    restarted = workers.tier(0, 1, store_dir)  # a restarted worker finds the node's store
    try:
        target = {
            "model": {"w0": torch.zeros(3, 4), "w1": placeholder((5, 7), torch.bfloat16)},
            "optim": {
                "w0": {"exp_avg": torch.zeros(3, 4).bfloat16()},
                "w1": {"exp_avg": placeholder((5, 7), torch.bfloat16)},
            },
            "train": {"step": -1},
        }
        outcome = restarted.restore(target, None)
    finally:
        restarted.close()
    assert (outcome.step, outcome.source) == (5, "own"), outcome.excluded
    assert torch.equal(target["model"]["w0"], torch.arange(12.0).reshape(3, 4) + 5)
    assert torch.equal(target["optim"]["w0"]["exp_avg"], torch.full((3, 4), 5.0).bfloat16())
    assert target["train"] == {"step": 5}
    for value in (target["model"]["w1"], target["optim"]["w1"]["exp_avg"]):
        assert held_elsewhere(value) and value.shape == (5, 7) and value.dtype == torch.bfloat16
