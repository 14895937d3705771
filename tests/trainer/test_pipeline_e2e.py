"""Pipeline parallelism end to end: real torchrun jobs of the tiny recipe (4 layers) on gloo.

Six jobs shared by the tests below:

- ``pp2``: pp=2 x dp_shard=2 (1F1B, 4 microbatches; 4 ranks), 8 steps, checkpoints at 4 and 8;
- ``pp1``: pp=1 x dp_shard=2 (2 ranks) on the same data, 8 steps;
- ``split``: ``pp2``'s directory as a crash after step 8 leaves it had the step-8 checkpoint never
  committed, resumed on pp=2 x dp_shard=2: it redoes steps 5-8;
- ``to_pp1``: the same crash resumed on pp=1 x dp_shard=2;
- ``to_one``: the same crash resumed in one plain process (no torchrun);
- ``to_pp2``: ``pp1``'s crash resumed on pp=2 x tp=2 with sequence parallelism, the interleaved
  1F1B schedule (4 stages) and activation checkpointing, through the ``resilient-train`` launcher
  (which starts pp x dp_shard x tp = 4 ranks).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer
from resilient.storage.offline.catalog import open_newest_readable, summarize
from resilient.trainer.config import load_config
from tests.trainer.e2e_runs import (
    STEPS,
    STOP_AT,
    TINY,
    crashed_copy,
    load_tensors,
    run_job,
    set_args,
    step_metrics,
    step_samples,
    torchrun,
)

pytestmark = [pytest.mark.e2e]

LAYERS = "model.n_layers=4"
PP2 = ("parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=1", "parallel.pp_microbatches=4", LAYERS)
PP1 = ("parallel.pp=1", "parallel.dp_shard=2", "parallel.tp=1", LAYERS)
ONE = ("parallel.pp=1", "parallel.dp_shard=1", "parallel.tp=1", LAYERS)
PP2_TP2 = (
    "parallel.pp=2",
    "parallel.dp_shard=1",
    "parallel.tp=2",
    "parallel.sequence_parallel=true",
    'parallel.pp_schedule="interleaved1F1B"',
    'parallel.activation_checkpointing="full"',
    LAYERS,
)


# The module fixture's 6 jobs (3 of them on 4 ranks) take ~60 s here; the first test's timeout covers
# them with room for a loaded machine (each job is also bounded by RUN_TIMEOUT_S and killed whole).
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    pp2, pp1 = root / "pp2", root / "pp1"
    torchrun(4, pp2, *PP2)
    torchrun(2, pp1, *PP1)
    split = crashed_copy(pp2, root / "split", STOP_AT)
    resumed = torchrun(4, split, *PP2)
    assert f"resumed from step {STOP_AT}" in resumed.stdout and "pp=2 x dp_shard=2 x tp=1" in resumed.stdout
    to_pp1 = crashed_copy(pp2, root / "to_pp1", STOP_AT)
    moved = torchrun(2, to_pp1, *PP1)
    assert f"resumed from step {STOP_AT}" in moved.stdout and "dp_shard=2 x tp=1" in moved.stdout
    to_one = crashed_copy(pp2, root / "to_one", STOP_AT)
    moved = run_job([sys.executable, "-m", "resilient.trainer", "--config", TINY, *set_args(to_one, *ONE)])
    assert f"resumed from step {STOP_AT}" in moved.stdout and "dp_shard=1 x tp=1" in moved.stdout
    to_pp2 = crashed_copy(pp1, root / "to_pp2", STOP_AT)
    launcher = [sys.executable, "-m", "resilient.tools.train", "--config", TINY]
    moved = run_job([*launcher, *set_args(to_pp2, *PP2_TP2)])
    assert f"resumed from step {STOP_AT}" in moved.stdout and "pp=2 x dp_shard=1 x tp=2" in moved.stdout
    return {"pp2": pp2, "pp1": pp1, "split": split, "to_pp1": to_pp1, "to_one": to_one, "to_pp2": to_pp2}


@pytest.mark.timeout(900)
def test_pipelined_run_loses_loss_as_the_unpipelined_one(runs: dict[str, Path]) -> None:
    pp2, pp1 = step_metrics(runs["pp2"]), step_metrics(runs["pp1"])
    assert list(pp2) == list(pp1) == list(range(1, STEPS + 1))
    for step in pp1:
        # The same global batch and the same summed gradient; only the order of float sums differs.
        assert abs(pp2[step]["loss"] - pp1[step]["loss"]) < 1e-4, f"step {step}"
        assert pp2[step]["grad_norm"] == pytest.approx(pp1[step]["grad_norm"], rel=1e-4), f"step {step}"
    assert step_samples(runs["pp2"]) == step_samples(runs["pp1"])
    losses = [pp2[s]["loss"] for s in pp2]
    assert sum(losses[-2:]) / 2 < 0.8 * losses[0], losses


@pytest.mark.timeout(900)
def test_same_layout_resume_is_bit_identical(runs: dict[str, Path]) -> None:
    full, split = step_metrics(runs["pp2"]), step_metrics(runs["split"])
    for step in full:
        assert split[step]["loss"] == full[step]["loss"], f"step {step}"
        assert split[step]["grad_norm"] == full[step]["grad_norm"], f"step {step}"
    expected, got = load_tensors(runs["pp2"], STEPS), load_tensors(runs["split"], STEPS)
    assert sorted(got) == sorted(expected)
    for fqn, tensor in expected.items():
        assert torch.equal(got[fqn], tensor), fqn


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "source"), [("to_pp1", "pp2"), ("to_one", "pp2"), ("to_pp2", "pp1")])
def test_resume_across_pipeline_layouts_is_exactly_once(runs: dict[str, Path], name: str, source: str) -> None:
    moved, straight = step_metrics(runs[name]), step_metrics(runs[source])
    assert list(moved) == list(range(1, STEPS + 1))
    for step in range(STOP_AT + 1, STEPS + 1):
        assert abs(moved[step]["loss"] - straight[step]["loss"]) < 1e-4, f"step {step}"
    samples = step_samples(runs[name])
    assert samples == step_samples(runs[source])
    seen = Counter(sid for ids in samples.values() for sid in ids)
    assert max(seen.values()) == 1, [sid for sid, n in seen.items() if n > 1]
    num_samples = load_config(TINY).data.pipeline.num_samples
    epochs = sorted({int(sid.split(":")[0]) for sid in seen})
    assert len(epochs) >= 2
    for epoch in epochs[:-1]:
        assert sorted(int(s.split(":")[1]) for s in seen if s.startswith(f"{epoch}:")) == list(range(num_samples))


@pytest.mark.timeout(900)
def test_checkpoints_keep_global_names_and_shapes_whatever_the_split(runs: dict[str, Path]) -> None:
    pipelined, whole = load_tensors(runs["pp2"], STEPS), load_tensors(runs["pp1"], STEPS)
    assert sorted(pipelined) == sorted(whole)
    assert {f for f in whole if f.startswith("model.layers.3.")}, "the last stage's blocks are saved by name"
    for fqn, tensor in whole.items():
        assert pipelined[fqn].shape == tensor.shape, fqn
    ref, _ = open_newest_readable(str(runs["pp1"] / "ckpt"), None)
    unpipelined_groups = summarize(ref)["values"]["optim.param_groups"]
    saved_on = {"pp2": {"pp": 2, "dp_shard": 2, "tp": 1}, "to_pp2": {"pp": 2, "dp_shard": 1, "tp": 2}}
    for run, mesh in saved_on.items():
        ref, _ = open_newest_readable(str(runs[run] / "ckpt"), None)
        summary = summarize(ref)
        assert summary["save_mesh"] == mesh, run
        # One value for all ranks (not one per rank), equal to what a run without pipelining saves.
        assert summary["values"]["optim.param_groups"] == unpipelined_groups, run
    shown = run_job([sys.executable, "-m", "resilient.tools.ckpt", "inspect", str(runs["pp2"] / "ckpt")])
    assert "save-time mesh pp=2 x dp_shard=2 x tp=1" in shown.stdout
    manifest = json.loads((runs["pp1"] / "ckpt" / f"step-{STEPS:09d}" / "manifest.json").read_text())
    assert manifest["metadata"]["mesh"] == {"dp_shard": 2, "tp": 1}
    assert Checkpointer(str(runs["to_pp2"] / "ckpt")).steps() == [STOP_AT, STEPS]
