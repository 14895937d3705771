"""The trainer end to end: real torchrun jobs of the tiny recipe on gloo, resumed after a "crash".

Three jobs, shared by the tests below (a 4-rank torchrun costs seconds of start-up here):

- ``full``:    2x2 (dp_shard x tp), 8 steps straight, checkpoints at 4 and 8, with a step hook
  (``train_hooks.py``);
- ``split``:   the full run's directory as a crash after step 8 would leave it had the step-8
  checkpoint never committed: logs up to step 8, checkpoints up to step 4. Started again on 2x2, it
  resumes from step 4 and redoes steps 5-8, logging them a second time;
- ``reshard``: the same crashed directory resumed on 2 ranks (dp_shard=2, tp=1), through the
  ``resilient-train`` launcher.

The resumed run must be bit-identical to the straight one (losses and every saved tensor); the
resharded one must see the same samples and nearly the same losses; the loss must fall; and every
sample must be consumed exactly once per epoch across the resume. (Stopping cleanly with
``run.steps=k`` and extending the run is what ``make demo`` does.)
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer
from resilient.trainer.config import load_config
from tests.trainer.e2e_runs import (
    STEPS,
    STOP_AT,
    TINY,
    crashed_copy,
    load_tensors,
    logged_steps,
    run_job,
    set_args,
    step_metrics,
    step_samples,
    torchrun,
)

pytestmark = [pytest.mark.e2e]

HOOK = "tests.trainer.train_hooks:record_steps"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    full = root / "full"
    torchrun(4, full, f"run.step_hooks={json.dumps([HOOK])}")
    split = crashed_copy(full, root / "split", STOP_AT)
    resumed = torchrun(4, split)
    assert f"resumed from step {STOP_AT}" in resumed.stdout
    reshard = crashed_copy(full, root / "reshard", STOP_AT)
    launcher = [sys.executable, "-m", "resilient.tools.train", "--nproc", "2", "--config", TINY]
    moved = run_job([*launcher, *set_args(reshard, "parallel.tp=1")])
    assert f"resumed from step {STOP_AT}" in moved.stdout and "dp_shard=2 x tp=1" in moved.stdout
    return {"full": full, "split": split, "reshard": reshard}


@pytest.mark.timeout(600)
def test_resume_on_same_mesh_is_bit_identical(runs: dict[str, Path]) -> None:
    full, split = step_metrics(runs["full"]), step_metrics(runs["split"])
    assert list(full) == list(split) == list(range(1, STEPS + 1))
    redone = list(range(STOP_AT + 1, STEPS + 1))
    for name in ("split", "reshard"):  # the resumed runs appended the steps they redid
        for log in ("metrics.jsonl", "samples.jsonl"):
            assert logged_steps(runs[name], log) == list(range(1, STEPS + 1)) + redone, (name, log)
    for step in full:
        assert split[step]["loss"] == full[step]["loss"], f"step {step}"
        assert split[step]["grad_norm"] == full[step]["grad_norm"], f"step {step}"
    assert Checkpointer(str(runs["full"] / "ckpt")).steps() == [4, 8]
    assert Checkpointer(str(runs["split"] / "ckpt")).steps() == [4, 8]
    expected, got = load_tensors(runs["full"], STEPS), load_tensors(runs["split"], STEPS)
    assert sorted(got) == sorted(expected)
    assert any(fqn.startswith("optim.state.") for fqn in expected)
    for fqn, tensor in expected.items():
        assert torch.equal(got[fqn], tensor), fqn


@pytest.mark.timeout(600)
def test_resume_on_other_mesh_sees_same_samples(runs: dict[str, Path]) -> None:
    assert step_samples(runs["reshard"]) == step_samples(runs["full"])
    full, moved = step_metrics(runs["full"]), step_metrics(runs["reshard"])
    assert list(moved) == list(full)
    for step in full:
        # tp=1 adds the row-parallel partial sums in another order: equal up to float rounding.
        assert moved[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-4), f"step {step}"
    expected, got = load_tensors(runs["full"], STEPS), load_tensors(runs["reshard"], STEPS)
    for fqn in (f for f in expected if f.startswith("model.")):
        torch.testing.assert_close(got[fqn], expected[fqn], rtol=1e-3, atol=1e-4, msg=fqn)


@pytest.mark.timeout(600)
def test_loss_falls(runs: dict[str, Path]) -> None:
    losses = [record["loss"] for record in step_metrics(runs["full"]).values()]
    assert sum(losses[-2:]) / 2 < 0.8 * losses[0], losses
    record = step_metrics(runs["full"])[STEPS]
    assert record["tokens"] == 8 * 128 and record["tokens_per_s"] > 0 and 0 < record["mfu"] < 1
    for key in ("step_time_s", "data_wait_s", "ckpt_stall_s"):
        assert record[key] >= 0, key


@pytest.mark.timeout(600)
def test_every_sample_once_per_epoch_across_resume(runs: dict[str, Path]) -> None:
    num_samples = load_config(TINY).data.pipeline.num_samples
    for name in ("split", "reshard"):
        samples = step_samples(runs[name])
        assert list(samples) == list(range(1, STEPS + 1)), name
        seen = Counter(sid for ids in samples.values() for sid in ids)
        assert max(seen.values()) == 1, f"{name}: repeated {[s for s, n in seen.items() if n > 1]}"
        epochs = {int(sid.split(":")[0]) for sid in seen}
        assert len(epochs) >= 2, f"{name}: the run should cross an epoch boundary"
        for epoch in sorted(epochs)[:-1]:  # every epoch but the last, unfinished one is complete
            indices = sorted(int(sid.split(":")[1]) for sid in seen if sid.startswith(f"{epoch}:"))
            assert indices == list(range(num_samples)), f"{name}: epoch {epoch}"


@pytest.mark.timeout(600)
def test_step_hooks_run_on_every_rank_after_each_committed_step(runs: dict[str, Path]) -> None:
    logs = [(runs["full"] / f"hook-rank{rank}.txt").read_text().splitlines() for rank in range(4)]
    assert all(log == logs[0] for log in logs), "ranks disagree on steps or data cursors"
    assert [int(line.split()[0]) for line in logs[0]] == list(range(1, STEPS + 1))
    cursors = [line.split()[1] for line in logs[0]]
    assert len(set(cursors)) == STEPS  # the cursor moved at every committed step


@pytest.mark.timeout(300)
def test_resume_with_other_data_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copytree(runs["full"] / "ckpt", tmp_path / "ckpt")
    # One plain process (no torchrun): the trainer makes itself a one-rank world.
    overrides = set_args(tmp_path, "parallel.dp_shard=1", "parallel.tp=1", "data.seed=1")
    failed = run_job([sys.executable, "-m", "resilient.trainer", "--config", TINY, *overrides], expect_ok=False)
    assert "data-pipeline fingerprint mismatch" in failed.stderr
    assert "seed: checkpoint 0, pipeline 1" in failed.stderr
    assert Checkpointer(str(tmp_path / "ckpt")).steps() == [4, 8]  # nothing written over
