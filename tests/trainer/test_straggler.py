"""Naming the rank that is really slow: held from outside (SIGSTOP/SIGCONT duty cycle) under FSDP,
TP and PP, nobody in a clean run, the slow loader by its data wait. Unit checks of the episode
logic and of the stall clock first, then real 2-rank runs (``tests/trainer/straggler_runs.py``)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from resilient.chaos.throttle import DutyCycle
from resilient.trainer.observing.straggler import GroupWatch, StallClock, StragglerWatch
from resilient.trainer.observing.timing import PHASES
from tests.trainer.straggler_runs import throttled_run

NAMED_WITHIN = 15
"""Steps from the first throttled step to the `straggler` event: `straggler_windows` (2) full windows
of `rank_every` (5) steps after the one the hold starts in, which is slow in most of its steps, and
so counts, only when the hold starts early in it (10 steps then; 12 seen under CI load)."""


def _window(stalled: tuple[float, ...], step_s: float = 0.1, **phase: tuple[float, ...]) -> list[dict[str, float]]:
    out = []
    for rank, held in enumerate(stalled):
        entry = {"rank": rank, **dict.fromkeys(PHASES, 0.01), "step_s": step_s, "stalled_s": held, "late_s": 0.0}
        entry.update({name: values[rank] for name, values in phase.items()})
        out.append(entry)
    return out


@pytest.mark.timeout(10)
def test_a_held_rank_starts_one_episode_and_clears_after_clean_windows() -> None:
    watch = StragglerWatch(factor=1.5, windows=2)
    held = _window((0.0, 0.04, 0.001))
    assert watch.check(held, step=5) == []  # one window: not yet
    (started,) = watch.check(held, step=10)
    assert (started["event"], started["rank"], started["phase"]) == ("straggler", 1, "stalled_s")
    assert started["value_s"] == 0.04 and started["median_s"] == 0.0005 and started["share"] == pytest.approx(0.395)
    assert started["stalled_s"] == 0.04 and started["median_stalled_s"] == 0.0005 and "median_late_s" in started
    assert watch.check(held, step=15) == []  # the same episode: said once
    assert watch.check(_window((0.0, 0.0, 0.0)), step=20) == []  # one clean window does not end it
    assert watch.check(held, step=25) == []  # slow again: still the same episode
    assert watch.check(_window((0.0, 0.0, 0.0)), step=30) == []
    (cleared,) = watch.check(_window((0.0, 0.005, 0.0)), step=35)  # 5% of the step: noise
    assert (cleared["event"], cleared["rank"], cleared["phase"], cleared["started_step"]) == (
        "straggler_cleared",
        1,
        "stalled_s",
        10,
    )
    assert cleared["first_slow_step"] == 5 and cleared["duration_steps"] == 30 and watch.open_episodes() == {}


@pytest.mark.timeout(10)
def test_own_work_phases_still_name_a_rank_and_noise_names_nobody() -> None:
    watch = StragglerWatch(factor=1.5, windows=2)
    slow_loader = _window((0.0, 0.0, 0.0), data_wait_s=(0.005, 0.06, 0.005))
    watch.check(slow_loader, step=2)
    (event,) = watch.check(slow_loader, step=4)
    assert (event["rank"], event["phase"], event["ratio"]) == (1, "data_wait_s", 12.0)
    # A waiter's long compute under FSDP is everyone's: equal phases name nobody.
    fsdp = StragglerWatch(1.5, 1)
    assert fsdp.check(_window((0.0, 0.0), compute_s=(0.09, 0.093))) == []
    # Sub-millisecond ratios, or an excess under a quarter of the step, are noise.
    assert fsdp.check(_window((0.0, 0.0, 0.0), data_wait_s=(0.0001, 0.0001, 0.0009))) == []
    assert fsdp.check(_window((0.0, 0.0, 0.0), data_wait_s=(0.004, 0.004, 0.024))) == []
    assert fsdp.check(_window((0.0, 0.008, 0.0))) == []
    # One step of five waited 0.3 s on a busy host: the mean is slow, the typical step is not.
    hiccup = _window((0.0, 0.0), data_wait_s=(0.064, 0.004), data_wait_s_p50=(0.004, 0.004))
    assert fsdp.check(hiccup) == []
    assert [
        e["rank"] for e in fsdp.check(_window((0.0, 0.0), data_wait_s=(0.064, 0.004), data_wait_s_p50=(0.06, 0.004)))
    ] == [0]


@pytest.mark.timeout(10)
def test_a_group_held_as_a_whole_is_named_as_a_group_by_itself(tmp_path) -> None:
    from resilient.runfiles import append_jsonl

    paths = {g: str(tmp_path / f"group{g}" / "ranks.jsonl") for g in range(3)}

    def peers_write(step: int, held: float = 0.0) -> None:
        for g in (0, 2):
            append_jsonl(paths[g], {"step": step, "steps": 5, "ranks": _window((held, 0.002))})

    slow = GroupWatch(1, paths, windows=2, window_steps=5)
    fine = GroupWatch(0, paths, windows=2, window_steps=5)
    assert slow.check(_window((0.04, 0.05)), step=5, steps=5) == []  # no peer window yet: nothing to compare
    peers_write(5)
    peers_write(10)
    assert fine.check(_window((0.0, 0.002)), step=10, steps=5) == []
    assert slow.check(_window((0.04, 0.05)), step=10, steps=5) == []  # one window
    peers_write(15)
    (event,) = slow.check(_window((0.04, 0.05)), step=15, steps=5)
    assert (event["event"], event["rank"], event["scope"], event["phase"]) == ("straggler", None, "group", "stalled_s")
    assert event["value_s"] == 0.04 and event["median_s"] == 0.0 and event["groups_compared"] == 3
    # A partial window (the group just joined: its start-up reads as stalled) is left out.
    assert GroupWatch(1, paths, 1, 5).check(_window((0.04, 0.05)), step=15, steps=3) == []
    assert len(GroupWatch(1, paths, 1, 5).check(_window((0.04, 0.05)), step=15, steps=5)) == 1
    # One rank of a group held: a rank straggler inside it, not a slow group.
    assert GroupWatch(1, paths, 1, 5).check(_window((0.0, 0.05)), step=15, steps=5) == []
    peers_write(20)
    peers_write(25)
    assert slow.check(_window((0.0, 0.0)), step=20, steps=5) == []
    (cleared,) = slow.check(_window((0.001, 0.0)), step=25, steps=5)
    assert (cleared["event"], cleared["rank"], cleared["started_step"]) == ("straggler_cleared", None, 15)
    # Peers out of the quorum (their newest window is old) are not compared.
    assert GroupWatch(1, paths, 1, 5).check(_window((0.04, 0.05)), step=60, steps=5) == []


_CLOCK = (
    "import sys, time; sys.path.insert(0, '.');"
    "from resilient.trainer.observing.straggler import StallClock;"
    "c = StallClock().start(); print('ready', flush=True); time.sleep(float(sys.argv[1])); print(c.held_s())"
)


@pytest.mark.timeout(30)
def test_the_stall_clock_counts_stops_from_outside_and_not_waits() -> None:
    clock = StallClock().start()
    time.sleep(0.3)  # blocked, as a rank waiting in a collective: not held
    assert clock.held_s() < 0.05
    clock.stop()
    proc = subprocess.Popen([sys.executable, "-c", _CLOCK, "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        throttle = DutyCycle(proc.pid, 0.4, period_s=0.1, seed=0).start()
        time.sleep(1.2)
        throttle.stop()
        held = float(proc.communicate(timeout=20)[0].strip())
    finally:
        proc.kill()
    assert 0.3 <= throttle.share() <= 0.5
    stopped = throttle.stopped_s
    assert stopped * 0.7 <= held <= stopped * 1.3, (held, stopped)


def _assert_one_named(run, rank: int) -> dict:
    assert run.first_step > 0 and run.last_step - run.first_step >= 15, (run.first_step, run.last_step)
    assert run.share >= 0.3, run.share
    assert [(e["rank"], e["phase"]) for e in run.stragglers] == [(rank, "stalled_s")], run.stragglers
    (event,) = run.stragglers
    assert event["step"] - run.first_step <= NAMED_WITHIN, (event["step"], run.first_step)
    assert event["stalled_s"] - event["median_stalled_s"] >= 0.2 * event["step_s"]
    assert {"late_s", "median_late_s", "value_s", "median_s", "group"} <= set(event)
    assert run.err.count(f"rank {rank} is a straggler") == 1
    windows = {w["step"]: {r["rank"]: r for r in w["ranks"]} for w in run.ranks}
    assert all({"stalled_s", "late_s", "compute_s"} <= set(r) for w in windows.values() for r in w.values())
    return event


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_fsdp_rank_held_from_outside_is_named_and_cleared(tmp_path) -> None:
    run = throttled_run(tmp_path / "fsdp", 42, "parallel.tp=1", "parallel.dp_shard=2", rank=1, span=16)
    _assert_one_named(run, 1)
    # Under FSDP the waiter's compute grows as much as the held rank's: the old rule's blind spot.
    (cleared,) = run.cleared
    assert cleared["rank"] == 1 and cleared["step"] > run.last_step and cleared["duration_steps"] >= 15
    assert run.err.count("rank 1 is no longer a straggler") == 1


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_tp_rank_held_from_outside_is_named(tmp_path) -> None:
    run = throttled_run(tmp_path / "tp", 28, "parallel.tp=2", "parallel.dp_shard=1", rank=0, span=18)
    _assert_one_named(run, 0)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_pp_held_stage_is_named(tmp_path) -> None:
    sets = ("parallel.tp=1", "parallel.dp_shard=1", "parallel.pp=2")
    run = throttled_run(tmp_path / "pp", 28, *sets, rank=1, span=18)
    _assert_one_named(run, 1)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_clean_run_names_nobody_and_a_slow_loader_is_named_by_its_wait(tmp_path) -> None:
    clean = throttled_run(tmp_path / "clean", 40, "parallel.tp=1", "parallel.dp_shard=2", rank=None)
    assert clean.stragglers == [] and clean.cleared == [] and len(clean.ranks) == 8
    slow_loader = "data.next_batch=pause:0.12@rank1"
    sets = ("parallel.tp=1", "parallel.dp_shard=2")
    slow = throttled_run(tmp_path / "loader", 15, *sets, rank=None, faults=slow_loader)
    assert [(e["rank"], e["phase"]) for e in slow.stragglers] == [(1, "data_wait_s")], slow.stragglers
    assert slow.stragglers[0]["step"] in (10, 15)
    event = slow.stragglers[0]  # waiting for its loader is not being held
    assert event["stalled_s"] - event["median_stalled_s"] < 0.1 * event["step_s"]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_replica_group_held_as_a_whole_is_named_as_a_group(tmp_path) -> None:
    groups = ("--replica-groups", "2", "--nproc-per-group", "1")
    sets = ("parallel.tp=1", "parallel.dp_shard=1")
    run = throttled_run(tmp_path / "groups", 56, *sets, rank=0, group=1, groups=2, launch=groups, after=6, span=18)
    assert run.share >= 0.3 and run.last_step - run.first_step >= 15, (run.share, run.first_step, run.last_step)
    assert [(e["group"], e["rank"], e.get("scope")) for e in run.stragglers] == [(1, None, "group")], run.stragglers
    (event,) = run.stragglers
    assert event["step"] - run.first_step <= NAMED_WITHIN and event["groups_compared"] == 2
    assert event["value_s"] - event["median_s"] >= 0.2 * event["step_s"]
