"""``node_away`` (a node absent across a RAM restore, then back with its stale snapshots) against
stand-in rank processes, and the invariant that catches a restore of a stale snapshot,
``ram_restores_on_branch``, judged on recorded events. The scenario itself
(``chaos/scenarios/node_away.toml``, a job and its fault-free twin: too long for the suite) is run by
hand; its numbers are in benchmarks/README.md."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from resilient.chaos import invariants as inv
from resilient.chaos.inject import FaultRecord, advance
from resilient.chaos.job import job_node_store_dir
from resilient.chaos.scenario import FaultSpec, load_scenario, parse_scenario
from resilient.errors import ConfigError
from tests.procs import wait_until

pytestmark = [pytest.mark.timeout(60)]


def _snapshots(directory: str, *steps: int) -> None:
    os.makedirs(directory, exist_ok=True)
    for step in steps:
        Path(directory, f"step-{step:09d}.json").write_text("{}")


def _steps(directory: str) -> list[int]:
    return sorted(int(name[5:14]) for name in os.listdir(directory) if name.startswith("step-"))


def test_node_away_sets_the_store_aside_then_brings_it_back_once_the_step_is_retrained(node) -> None:
    ctx, start_rank = node
    ctx.job.events = SimpleNamespace(records=[])
    away, other = (job_node_store_dir(ctx.config, ctx.job.run_dir, 0, n) for n in (1, 0))
    _snapshots(os.path.join(away, "own", "rank1"), 4, 6)
    _snapshots(os.path.join(other, "buddy", "rank1"), 4, 6)  # node 0 keeps rank 1's copies
    _snapshots(os.path.join(other, "own", "rank0"), 4, 6)
    survivor, leaving = start_rank(0, other), start_rank(1, away)
    record = FaultRecord(spec=FaultSpec(kind="node_away", at_step=7, group=0, node=1))
    advance(record, ctx, t_first_commit=None)
    assert record.state == "injected", record.note
    assert leaving.wait(timeout=10) == -9 and survivor.poll() is None
    assert _stat(survivor.pid) != "T", "the other node's rank runs on"
    assert not os.path.exists(away) and _steps(os.path.join(away + ".away", "own", "rank1")) == [4, 6]
    # Step 6 had not reached the buddy: the group can restore 4 only.
    assert _steps(os.path.join(other, "buddy", "rank1")) == [4] and _steps(os.path.join(other, "own", "rank0")) == [
        4,
        6,
    ]
    assert record.extra["away_step"] == 6 and record.extra["dropped_copies"] == [
        "node0/buddy/rank1/step-000000006.json"
    ]
    # The group restarts without the node (a replacement rank 1, a new store) and retrains 5..7.
    replacement = start_rank(1, away)
    wait_until(lambda: os.path.isdir(away))
    ctx.attempts[0] = 1
    ctx.job.events.records += [
        {"event": "step", "group": 0, "step": 7, "committed": True},  # before the restart: not retrained
        {"event": "joining", "group": 0, "attempt": 1},
        {"event": "step", "group": 0, "step": 6, "committed": True},
    ]
    advance(record, ctx, t_first_commit=None)
    assert record.state == "injected" and replacement.poll() is None, "step 7 is not retrained yet"
    ctx.job.events.records.append({"event": "step", "group": 0, "step": 7, "committed": True})
    advance(record, ctx, t_first_commit=None)
    assert record.state == "done", record.note
    assert replacement.wait(timeout=10) == -9 and survivor.poll() is None
    # The node is back with the store it left with: its own snapshot of step 6 of the old branch.
    assert _steps(os.path.join(away, "own", "rank1")) == [4, 6] and not os.path.exists(away + ".away")
    assert [k["pid"] for k in record.killed] == [leaving.pid, replacement.pid] and record.rejoin == {0: 2}


def test_node_away_with_no_snapshot_on_the_node_fails_and_lets_every_rank_run_on(node) -> None:
    ctx, start_rank = node
    away, other = (job_node_store_dir(ctx.config, ctx.job.run_dir, 0, n) for n in (1, 0))
    _snapshots(os.path.join(other, "own", "rank0"), 4)
    survivor, staying = start_rank(0, other), start_rank(1, away)  # node 1's store holds no step file
    wait_until(lambda: os.path.isdir(away))
    record = FaultRecord(spec=FaultSpec(kind="node_away", at_step=7, group=0, node=1))
    advance(record, ctx, t_first_commit=None)
    assert record.state == "failed" and "holds no RAM snapshot" in record.note, record.note
    assert record.killed == [] and os.path.isdir(away) and not os.path.exists(away + ".away")
    # Both ranks were frozen; neither was killed, so both must run on (a stopped rank hangs the group).
    assert _stat(survivor.pid) != "T" and _stat(staying.pid) != "T"
    assert survivor.poll() is None and staying.poll() is None


def _stat(pid: int) -> str:
    for _ in range(100):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state != "T":
            return state
        time.sleep(0.02)
    return state


def test_node_away_needs_a_second_node_and_the_scenario_parses() -> None:
    scenario = load_scenario("node_away")
    (fault,) = scenario.faults
    assert (fault.kind, fault.node, fault.expect_restore_source) == ("node_away", 1, "buddy")
    assert fault.takes_group_down and scenario.check.twin
    job = {"config": "configs/tiny.toml", "replica_groups": 1, "nproc_per_group": 2, "ranks_per_node": 2}
    with pytest.raises(ConfigError, match=r"node_away needs a second node \(job.ranks_per_node < nproc_per_group\)"):
        parse_scenario({"job": job, "fault": [{"kind": "node_away", "at_step": 3, "group": 0, "node": 0}]})


def _restore(rank: int, step: int, snapshot: str, ancestors: list, source: str = "own") -> dict:
    return {
        "event": "restore",
        "group": 0,
        "rank": rank,
        "step": step,
        "source": source,
        "snapshot_timeline": snapshot,
        "ancestors": ancestors,
    }


def test_ram_restores_on_branch_fails_on_the_returning_nodes_stale_snapshot(tmp_path: Path) -> None:
    run = inv.RunData(run_dir=str(tmp_path), groups=1, steps=24, checkpoint_url=str(tmp_path / "ckpt"))
    branch = [["1-b", 6], ["0-a", 4]]  # restored 6 on 1-b, which branched off 0-a at 4
    run.events = [
        {"event": "restore", "group": 0, "rank": 0, "step": 0, "source": "fresh"},
        _restore(0, 4, "0-a", [["0-a", 4]]),
        _restore(1, 4, "0-a", [["0-a", 4]], "buddy"),
        _restore(0, 6, "1-b", branch),
        _restore(1, 6, "1-b", branch, "buddy"),
    ]
    verdict = inv.ram_restores_on_branch(run)
    assert verdict == inv.result(True, "4 rank restore(s) from RAM, each of a snapshot on the current branch")
    # Before RAM restores branched: node 1's rank took its own step 6 of the abandoned 0-a.
    run.events[-1] = _restore(1, 6, "0-a", branch)
    verdict = inv.ram_restores_on_branch(run)
    assert not verdict["ok"]
    assert "group 0 rank 1 restored step 6 of timeline '0-a', not of ['1-b']" in verdict["reason"]
    run.events[-1] = {k: v for k, v in _restore(1, 6, "1-b", branch).items() if k != "snapshot_timeline"}
    assert not inv.ram_restores_on_branch(run)["ok"], "a RAM restore that does not say what it took"
    run.events = run.events[:1]
    assert inv.ram_restores_on_branch(run) == inv.result(True, "no restore from RAM")
