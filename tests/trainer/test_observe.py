"""What a run records about itself (docs/observability.md): joinable records, the startup split,
each rank's step breakdown, stragglers and hangs. Unit checks, then two real 2-rank runs where one
rank is made slow, then stuck, at the trainer's ``trainer.compute`` fault point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.runfiles import append_jsonl, next_incarnation, read_events, read_jsonl, stamp_records
from resilient.trainer.observing.straggler import StragglerWatch
from resilient.trainer.observing.timing import PHASES, StartupClock, StepPhases
from tests.procs import communicate_or_fail

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")


def _ranks(*compute: float) -> list[dict[str, float]]:
    return [{"rank": r, **dict.fromkeys(PHASES, 0.01), "compute_s": c} for r, c in enumerate(compute)]


@pytest.mark.timeout(10)
def test_a_straggler_is_reported_once_per_episode_after_its_windows() -> None:
    watch = StragglerWatch(factor=1.5, windows=2)

    def said(compute: tuple[float, ...]) -> list[tuple[str, int, str]]:
        return [(e["event"], e["rank"], e["phase"]) for e in watch.check(_ranks(*compute))]

    assert said((0.10, 0.10, 0.20)) == []  # one slow window: not yet
    assert said((0.10, 0.10, 0.20)) == [("straggler", 2, "compute_s")]
    assert said((0.10, 0.10, 0.20)) == []  # the same episode
    assert said((0.10, 0.10, 0.11)) == []  # one window clean: not over yet
    assert said((0.10, 0.10, 0.11)) == [("straggler_cleared", 2, "compute_s")]
    said((0.10, 0.10, 0.20))
    assert said((0.10, 0.10, 0.20)) == [("straggler", 2, "compute_s")]  # a new episode
    assert StragglerWatch(1.5, 1).check(_ranks(0.0001, 0.0001, 0.0009)) == []  # sub-millisecond noise


@pytest.mark.timeout(10)
def test_phases_count_committed_attempts_only() -> None:
    phases = StepPhases()
    phases.add("compute_s", 0.5)
    phases.discard()  # an attempt the quorum did not commit
    phases.add("compute_s", 0.2)
    phases.commit(step_s=0.3)
    phases.add("compute_s", 0.4)
    phases.commit(step_s=0.5)
    means = dict(zip(PHASES, phases.means(), strict=True))
    assert phases.steps == 2 and means["compute_s"] == pytest.approx(0.3) and means["step_s"] == pytest.approx(0.4)
    clock = StartupClock(100.0)
    clock.marks = {"imports": 101.0, "process_group": 101.5, "model": 103.0}
    assert clock.phases() == {"imports_s": 1.0, "process_group_s": 0.5, "model_s": 1.5} and clock.total() == 3.0


@pytest.mark.timeout(10)
def test_records_carry_run_id_incarnation_and_time_once_stamped(tmp_path: Path) -> None:
    assert [next_incarnation(str(tmp_path), 0) for _ in range(3)] == [0, 1, 2]
    assert next_incarnation(str(tmp_path), 1) == 0  # per group
    path = str(tmp_path / "x.jsonl")
    append_jsonl(path, {"step": 1})
    try:
        stamp_records(run_id=None, incarnation=4)
        append_jsonl(path, {"step": 2})
        stamp_records(run_id="abc", incarnation=4)
        append_jsonl(path, {"step": 3, "t": 5.0})
    finally:
        from resilient import runfiles

        runfiles._identity.clear()
    first, second, third = read_jsonl(path)
    assert first == {"step": 1}
    assert second["incarnation"] == 4 and "run_id" not in second and second["t"] > 1e9
    assert (third["run_id"], third["incarnation"], third["t"]) == ("abc", 4, 5.0)


def _train(run_dir: Path, steps: int, faults: str, *sets: str, nproc: int = 2) -> str:
    command = [sys.executable, "-m", "resilient.tools.train", "--nproc", str(nproc), "--config", TINY]
    for item in (f'run.dir="{run_dir}"', f"run.steps={steps}", "parallel.tp=1", *sets):
        command += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RESILIENT_FAULTS": faults}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_or_fail(proc, 180, str(command))
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    return err


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_slow_rank_is_named_and_a_stuck_one_leaves_its_stacks(tmp_path: Path) -> None:
    slow = tmp_path / "slow"
    err = _train(
        slow,
        8,
        "trainer.compute=pause:0.15@rank1",
        "metrics.rank_every=2",
        "metrics.straggler_windows=2",
        "checkpoint.persist_every=8",
        "metrics.tensorboard=true",
    )
    ranks = read_jsonl(str(slow / "group0" / "ranks.jsonl"))
    assert [r["step"] for r in ranks] == [2, 4, 6, 8] and all(r["steps"] == 2 for r in ranks)
    for window in ranks[1:]:
        by_rank = {r["rank"]: r for r in window["ranks"]}
        assert by_rank[1]["compute_s"] > by_rank[0]["compute_s"] + 0.12
        assert by_rank[0]["grad_sync_s"] > 0.08  # rank 0 waits for rank 1 in the next collective
    events = read_events(str(slow))
    stragglers = [e for e in events if e["event"] == "straggler"]
    assert [(e["rank"], e["phase"], e["step"]) for e in stragglers] == [(1, "compute_s", 4)], stragglers
    assert "rank 1 is a straggler: compute_s" in err
    (startup,) = [e for e in events if e["event"] == "startup"]
    assert startup["layout"] == {"world": 2, "pp": 1, "dp_shard": 2, "tp": 1, "groups": 1}
    assert list(startup["phases"]) == ["imports_s", "process_group_s", "model_s", "restore_s", "first_step_s"]
    assert startup["total_s"] == pytest.approx(sum(startup["phases"].values()), abs=0.01)
    metrics = read_jsonl(str(slow / "group0" / "metrics.jsonl"))
    run_id = startup["run_id"]
    assert {(m["run_id"], m["incarnation"]) for m in metrics} == {(run_id, 0)} and all(m["t"] > 1e9 for m in metrics)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(slow / "group0" / "tensorboard"))
    board.Reload()
    losses = [(e.step, e.value) for e in board.Scalars("train/loss")]
    assert losses == [(m["step"], pytest.approx(m["loss"], rel=1e-6)) for m in metrics]

    # Resumed with rank 1 stuck for 4 s in its first step: both ranks' watchdogs fire (rank 0 waits in
    # a collective), then the step completes and the run ends normally, as incarnation 1.
    _train(slow, 9, "trainer.compute=pause:4@rank1", "run.hang_timeout_s=1.5", "checkpoint.persist_every=8")
    hangs = [e for e in read_events(str(slow)) if e["event"] == "hang"]
    assert sorted(e["rank"] for e in hangs) == [0, 1] and all(e["incarnation"] == 1 and e["step"] == 8 for e in hangs)
    for rank in (0, 1):
        stacks = (slow / "group0" / "hang" / f"rank{rank}-1.txt").read_text()
        assert "train_step" in stacks, stacks[:2000]
    assert (
        "time.sleep" in (slow / "group0" / "hang" / "rank1-1.txt").read_text()
        or "fault_point" in (slow / "group0" / "hang" / "rank1-1.txt").read_text()
    )
    assert json.loads((slow / "group0" / "incarnation.json").read_text())["incarnation"] == 1


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_clean_run_flags_no_straggler_and_its_records_join_across_a_resume(tmp_path: Path) -> None:
    run = tmp_path / "clean"
    sets = ("metrics.rank_every=2", "checkpoint.persist_every=3")
    _train(run, 6, "", *sets)
    _train(run, 9, "", *sets, "parallel.dp_shard=1", nproc=1)  # resumed on 1 rank: incarnation 1
    events = read_events(str(run))
    assert [e for e in events if e["event"] == "straggler"] == []
    metrics = read_jsonl(str(run / "group0" / "metrics.jsonl"))
    starts = [e for e in events if e["event"] == "startup"]
    assert [s["incarnation"] for s in starts] == [0, 1] and starts[1]["layout"]["world"] == 1
    assert [s["cause"] for s in starts] == ["first", "relaunched"]  # a single group records why too
    assert len({m["run_id"] for m in metrics}) == 1 and metrics[0]["run_id"] == starts[0]["run_id"]
    assert [(m["step"], m["incarnation"], m["layout"]["world"]) for m in metrics] == [
        *((s, 0, 2) for s in range(1, 7)),
        *((s, 1, 1) for s in range(7, 10)),
    ]
    from resilient.tools.report import write_report

    summary = write_report(str(run), str(run))
    good = summary["goodput"]
    assert sum(c["seconds"] for c in good["causes"].values()) == pytest.approx(good["total_s"], rel=0.02)
    assert summary["incarnations"]["count"] == 2 and summary["stragglers"] == []
    assert summary["step_time"]["p50"] > 0 and (run / "report.html").exists()
