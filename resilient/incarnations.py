"""Why each start of a run happened, and the failure history that follows from it (DESIGN §8c).

Every start of a replica group is an incarnation (``runfiles.next_incarnation``); its rank 0
writes one ``startup`` event after the first committed step, whose ``cause`` is one of ``CAUSES``:

- ``first``        incarnation 0 of the group;
- ``preempted``    the previous incarnation recorded a ``preempted`` event (the scheduler asked the
                   job to leave; its preemption path writes the event, saves, and exits 143);
- ``node_lost``    a rank's own RAM store was gone and it restored from its buddy's copy;
- ``rank_failed``  torchrun restarted the group's workers in place (a worker died);
- ``relaunched``   none of the above: the job was started again from outside (an operator, a
                   scheduler requeue, a launcher that died).

The evidence is read, never guessed from timing: the previous incarnation's events, the restore's
per-rank sources, torchrun's restart count. ``failure_history`` turns the startups into the
failures the adaptive cadence counts: a restart in place is a ``process`` failure, a lost node a
``node`` one, a relaunch a ``job`` one; a first start is none and so is a preemption (its path
saves first, so it costs a restart but no rework).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

CAUSES = ("first", "preempted", "node_lost", "rank_failed", "relaunched")
FAILURE_CLASS = {"rank_failed": "process", "node_lost": "node", "relaunched": "job"}
"""The cadence model's failure class of each cause that is a failure."""


def _of_group(event: dict[str, Any], group: int) -> bool:
    return event.get("group", group) == group  # job-wide events (no group) concern every group


def since_last_startup(events: Sequence[dict[str, Any]], group: int) -> list[dict[str, Any]]:
    """The events written after this group's last ``startup`` (all of them before its first)."""
    last = -1
    for i, event in enumerate(events):
        if event.get("event") == "startup" and _of_group(event, group):
            last = i
    return list(events[last + 1 :])


def startup_cause(
    events: Sequence[dict[str, Any]],
    *,
    group: int,
    incarnation: int,
    restart_count: int,
    restore_sources: Iterable[str],
) -> str:
    """This start's cause (``CAUSES``) from the run's events so far (``events.jsonl``, in file
    order, before this incarnation's ``startup``), the group's incarnation, torchrun's restart
    count (``TORCHELASTIC_RESTART_COUNT``) and every rank's restore source."""
    if incarnation == 0:
        return "first"
    if any(e.get("event") == "preempted" and _of_group(e, group) for e in since_last_startup(events, group)):
        return "preempted"
    if "buddy" in set(restore_sources):
        return "node_lost"
    if restart_count > 0:
        return "rank_failed"
    return "relaunched"


def start_time(event: dict[str, Any]) -> float | None:
    """When the process of a ``startup`` event started (the event is written after the first step)."""
    t = event.get("t")
    if not isinstance(t, int | float):
        return None
    return float(t) - float(event.get("total_s", 0.0) or 0.0)


def failure_history(events: Iterable[dict[str, Any]], group: int) -> tuple[float | None, list[tuple[float, str]]]:
    """``(when the run first started, [(time, failure class)])`` of one group, from its startups:
    each failure dated at the start it caused. ``(None, [])`` before the first startup."""
    first: float | None = None
    failures = []
    for event in events:
        if event.get("event") != "startup" or not _of_group(event, group):
            continue
        t = start_time(event)
        if t is None:
            continue
        first = t if first is None else min(first, t)
        cls = FAILURE_CLASS.get(str(event.get("cause", "")))
        if cls is not None:
            failures.append((t, cls))
    return first, failures
