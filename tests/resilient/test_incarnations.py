"""Why each start happened (the ``startup`` event's ``cause``) and the failures that follow."""

from __future__ import annotations

import pytest

from resilient.incarnations import failure_history, startup_cause

pytestmark = pytest.mark.timeout(30)


def _cause(events: list[dict], *, incarnation: int = 1, restarts: int = 0, sources: tuple = ("persistent",)) -> str:
    return startup_cause(events, group=0, incarnation=incarnation, restart_count=restarts, restore_sources=sources)


def test_each_cause_from_its_evidence():
    before = [{"event": "startup", "group": 0, "t": 10.0, "total_s": 2.0, "cause": "first"}]
    assert _cause([], incarnation=0) == "first"
    assert _cause([*before, {"event": "preempted", "group": 0, "step": 7}], restarts=1) == "preempted"
    assert _cause([*before, {"event": "preempted", "step": 7}]) == "preempted"  # job-wide, no group
    assert _cause([*before], sources=("own", "buddy"), restarts=1) == "node_lost"
    assert _cause([*before], sources=("own", "own"), restarts=2) == "rank_failed"
    assert _cause([*before], sources=("persistent",)) == "relaunched"


def test_a_preemption_before_the_previous_start_or_of_another_group_does_not_count():
    events = [
        {"event": "preempted", "group": 0, "step": 3},
        {"event": "startup", "group": 0, "t": 10.0, "cause": "preempted"},
        {"event": "preempted", "group": 1, "step": 9},
    ]
    assert _cause(events, restarts=1) == "rank_failed"
    assert startup_cause(events, group=1, incarnation=2, restart_count=0, restore_sources=["peer"]) == "preempted"


def test_failure_history_counts_failures_at_the_start_they_caused():
    events = [
        {"event": "startup", "group": 0, "t": 110.0, "total_s": 10.0, "cause": "first"},
        {"event": "startup", "group": 1, "t": 115.0, "total_s": 10.0, "cause": "first"},
        {"event": "startup", "group": 0, "t": 505.0, "total_s": 5.0, "cause": "rank_failed"},
        {"event": "startup", "group": 0, "t": 900.0, "total_s": 0.0, "cause": "preempted"},
        {"event": "startup", "group": 0, "t": 1300.0, "total_s": 0.0, "cause": "node_lost"},
        {"event": "startup", "group": 0, "t": 2000.0, "total_s": 0.0, "cause": "relaunched"},
        {"event": "restore", "group": 0, "t": 2001.0},
    ]
    start, failures = failure_history(events, 0)
    assert start == 100.0
    assert failures == [(500.0, "process"), (1300.0, "node"), (2000.0, "job")]
    assert failure_history([], 0) == (None, [])
