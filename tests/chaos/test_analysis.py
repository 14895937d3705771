"""Goodput and per-fault checks on synthetic events (no job is run)."""

from __future__ import annotations

import pytest

from resilient.chaos.analysis import goodput, restore_check
from resilient.chaos.inject import FaultRecord
from resilient.chaos.scenario import FaultSpec

pytestmark = [pytest.mark.timeout(30)]


def _commits(times: list[float]) -> list[dict]:
    return [
        {"t": t, "event": "step", "committed": True, "step": i + 1, "group": 0, "participants": 2}
        for i, t in enumerate(times)
    ]


def _cost(start: float, end: float, detected_s: float = 1.0) -> dict:
    return {"_window": (start, end), "detected_s": detected_s, "rolled_back_to": None, "pre_fault_step": 0}


STALL_KEYS = ("detect_s", "reconfigure_s", "reload_s", "replay_s")


def test_goodput_does_not_depend_on_the_order_faults_are_listed_in() -> None:
    """The fault listed first hit later: its window must not clip the earlier one away (each stall
    second is attributed once, whatever the scenario order)."""
    events = _commits([float(t) for t in range(1, 41) if not (10 < t < 15 or 20 < t < 25)])
    late, early = _cost(20.0, 25.0), _cost(10.0, 15.0)
    listed_late_first = goodput([late, early], events, [], t_launch=0.0, t_end=41.0)
    in_time_order = goodput([early, late], events, [], t_launch=0.0, t_end=41.0)
    assert listed_late_first == in_time_order
    assert listed_late_first["detect_s"] == pytest.approx(2.0)
    assert listed_late_first["reconfigure_s"] == pytest.approx(8.0)
    assert listed_late_first["productive_s"] == pytest.approx(39.0 - 10.0)
    parts = sum(listed_late_first[k] for k in (*STALL_KEYS, "productive_s", "startup_s", "shutdown_s"))
    assert parts == pytest.approx(listed_late_first["total_s"])


def test_overlapping_fault_windows_count_each_second_once() -> None:
    events = _commits([float(t) for t in range(1, 41) if not 10 < t < 25])
    second, first = _cost(15.0, 25.0, detected_s=2.0), _cost(10.0, 20.0, detected_s=2.0)
    good = goodput([second, first], events, [], t_launch=0.0, t_end=41.0)
    assert sum(good[k] for k in STALL_KEYS) == pytest.approx(15.0), good
    # The second fault's detection (15..17) lies inside the first's stall: not counted twice.
    assert good["detect_s"] == pytest.approx(2.0)
    assert good["productive_s"] == pytest.approx(39.0 - 15.0)


def _node_fault(expected: str | None = "buddy", injected: float | None = 10.0) -> FaultRecord:
    spec = FaultSpec(kind="kill_node", group=0, node=0, expect_restore_source=expected)
    return FaultRecord(spec=spec, state="done", t_injected=injected, killed=[{"group": 0, "rank": 0, "pid": 11}])


def _restore(t: float, rank: int, source: str) -> dict:
    return {"t": t, "event": "restore", "group": 0, "rank": rank, "step": 8, "source": source}


def test_restore_check_takes_each_killed_ranks_first_restore_after_the_fault() -> None:
    events = [
        _restore(1.0, 0, "fresh"),
        _restore(12.0, 1, "own"),
        _restore(12.5, 0, "buddy"),
        _restore(30.0, 0, "persistent"),
    ]
    check = restore_check(_node_fault(), events)
    assert check == {"expected": "buddy", "got": {"group0.rank0": "buddy"}, "ok": True}
    check = restore_check(_node_fault(expected="own"), events)
    assert not check["ok"] and "got {'group0.rank0': 'buddy'}" in check["reason"]
    check = restore_check(_node_fault(), [_restore(1.0, 0, "buddy")])
    assert not check["ok"] and check["got"] == {"group0.rank0": None}, "no restore after the fault"
    assert not restore_check(_node_fault(injected=None), events)["ok"]
