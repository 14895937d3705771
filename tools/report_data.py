"""A run directory read back for ``resilient-report``: every group's records, normalized.

Runs written before the issue-16 contract (docs/observability.md) lack ``t``, ``run_id`` and
``incarnation`` on their metrics rows, and ``ranks.jsonl``; they still report. Their incarnations
are found from the start events (``start`` of replica groups, else rank 0's ``restore``) or, with
none, from the step count going back; each row's time is then the incarnation's start plus the
step times so far (``timing = "synthesized"``: wall gaps between steps are not in it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from resilient.chaos.accounting import Commit, Incarnation, held_spans, run_goodput
from resilient.runfiles import (
    HOOK_EVENTS_FILE,
    METRICS_FILE,
    SAVES_FILE,
    chaos_dir,
    group_file,
    pid_path,
    read_events,
    read_jsonl,
)

RANKS_FILE = "ranks.jsonl"
RUN_ID_FILE = "run_id"


class ReportError(Exception):
    """The run directory cannot be reported on (missing, unreadable, no records)."""


@dataclass(slots=True)
class GroupRun:
    """One replica group's records; ``incarnations`` by index, each row has ``t`` and ``incarnation``."""

    group: int
    metrics: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    saves: list[dict[str, Any]]
    incarnations: dict[int, Incarnation] = field(default_factory=dict)
    timing: str = "recorded"

    @property
    def t_launch(self) -> float | None:
        starts = [i.start_t for i in self.incarnations.values()]
        if self.metrics:
            first = self.metrics[0]
            starts.append(first["t"] - first.get("step_time_s", 0.0))
        return min(starts, default=None)


@dataclass(slots=True)
class RunData:
    run_dir: str
    events: list[dict[str, Any]]
    groups: dict[int, GroupRun]
    holds: list[dict[str, Any]]
    run_id: str | None = None

    @property
    def timing(self) -> str:
        return "synthesized" if any(g.timing != "recorded" for g in self.groups.values()) else "recorded"


def load_run(run_dir: str) -> RunData:
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir}: no such run directory (pass the run.dir of a training run)")
    if not os.access(run_dir, os.R_OK | os.X_OK):
        raise ReportError(f"{run_dir}: run directory is not readable")
    events = sorted(read_events(run_dir), key=lambda e: e.get("t", 0.0))
    groups = {}
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("group") and name[5:].isdigit():
            group = int(name[5:])
            groups[group] = _load_group(run_dir, group, events)
    if not any(g.metrics for g in groups.values()):
        raise ReportError(
            f"{run_dir}: no group<G>/{METRICS_FILE} with a committed step (not a run directory, or no step ran)"
        )
    holds = read_jsonl(os.path.join(chaos_dir(run_dir), HOOK_EVENTS_FILE))
    return RunData(run_dir, events, groups, holds, _run_id(run_dir, groups, events))


def _run_id(run_dir: str, groups: dict[int, GroupRun], events: list[dict[str, Any]]) -> str | None:
    for g in groups.values():
        for row in g.metrics:
            if row.get("run_id"):
                return row["run_id"]
    try:
        with open(os.path.join(run_dir, RUN_ID_FILE)) as f:
            text = f.read().strip()
            if text:
                return text
    except OSError:
        pass
    return next((e["run_id"] for e in events if e.get("run_id")), None)


def _load_group(run_dir: str, group: int, events: list[dict[str, Any]]) -> GroupRun:
    metrics = read_jsonl(group_file(run_dir, METRICS_FILE, group))
    ranks = read_jsonl(group_file(run_dir, RANKS_FILE, group))
    saves = read_jsonl(group_file(run_dir, SAVES_FILE, group))
    run = GroupRun(group, [r for r in metrics if "step" in r], ranks, saves)
    mine = [e for e in events if e.get("group", 0) == group]
    anchors = _start_anchors(mine)
    if any("t" not in r for r in run.metrics) and not _times_from_commits(run.metrics, mine):
        run.timing = "synthesized"
        _assign_incarnations(run.metrics, anchors)
        _synthesize_times(run.metrics, anchors)
    elif any("incarnation" not in r for r in run.metrics):
        for row in run.metrics:  # a row belongs to the last start before it
            row.setdefault("incarnation", max(sum(a.get("t", 0.0) < row["t"] for a in anchors) - 1, 0))
    run.incarnations = _incarnations(run.metrics, mine, anchors, _mtime(pid_path(run_dir, group, 0)))
    _attach_quorum(run.metrics, mine)
    return run


def _times_from_commits(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
    """Old replica groups' rows: each takes the time of its ``step`` event (its commit), in order;
    False (nothing changed) unless every row has one."""
    pending: dict[int, list[float]] = {}
    for e in events:
        if e.get("event") == "step" and e.get("committed") and "t" in e:
            pending.setdefault(e["step"], []).append(float(e["t"]))
    times = []
    for row in rows:
        queue = pending.get(row["step"])
        if "t" not in row and not queue:
            return False
        times.append(row["t"] if "t" in row else queue.pop(0))
    for row, t in zip(rows, times, strict=True):
        row["t"] = t
    return True


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _start_anchors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One event per start of the group, in time order: ``joining`` (replica groups; written before
    the restore), else ``start``, else rank 0's ``restore``."""
    for kind in ("joining", "start"):
        found = [e for e in events if e.get("event") == kind]
        if found:
            return found
    return [e for e in events if e.get("event") == "restore" and e.get("rank", 0) == 0]


def _assign_incarnations(rows: list[dict[str, Any]], anchors: list[dict[str, Any]]) -> None:
    """Old rows: a new incarnation begins where the step goes back (a restart rolled back); a start
    event that restored step s with no rollback to s + 1 was a resume that went straight on: its
    incarnation begins at the row s + 1 that follows s."""
    starts = {i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"]}
    explained = {rows[i]["step"] - 1 for i in starts}
    for anchor in anchors[1:]:
        s = anchor.get("step")
        if len(starts) + 1 >= len(anchors) or not s or s in explained:
            continue
        follow = [i for i in range(1, len(rows)) if rows[i - 1]["step"] == s and rows[i]["step"] == s + 1]
        if follow:
            starts.add(follow[-1])
            explained.add(s)
    index = 0
    for i, row in enumerate(rows):
        index += i in starts
        row.setdefault("incarnation", index)


def _synthesize_times(rows: list[dict[str, Any]], anchors: list[dict[str, Any]]) -> None:
    clock, current = 0.0, None
    for row in rows:
        if row["incarnation"] != current:
            current = row["incarnation"]
            anchor = anchors[current]["t"] if current < len(anchors) and "t" in anchors[current] else None
            clock = max(clock, anchor) if anchor is not None else clock
        clock += float(row.get("step_time_s", 0.0))
        row.setdefault("t", clock)


def _incarnations(
    rows: list[dict[str, Any]], events: list[dict[str, Any]], anchors: list[dict[str, Any]], pid_t: float | None
) -> dict[int, Incarnation]:
    """Each incarnation's process start: its ``startup`` event (end minus ``total_s``), else the
    earliest of its first start event, its first row minus that step's time, the launcher's
    ``group_started`` (the first incarnation) and rank 0's pid file (written at process start; the
    last incarnation); and the restore it waited for."""
    out: dict[int, Incarnation] = {}
    startups = [e for e in events if e.get("event") == "startup"]
    restores = [e for e in events if e.get("event") == "restore"]
    indices = sorted({r["incarnation"] for r in rows})
    launched = [e["t"] for e in events if e.get("event") == "group_started" and "t" in e]
    previous_end = float("-inf")
    for index in indices:
        mine = [r for r in rows if r["incarnation"] == index]
        start = mine[0]["t"] - float(mine[0].get("step_time_s", 0.0))
        startup = _nth(startups, index)
        anchor = _nth(anchors, index)
        if startup is not None and "total_s" in startup:
            start = startup["t"] - float(startup["total_s"])
        else:
            if anchor is not None and "t" in anchor:
                start = min(start, anchor["t"])
            if index == indices[-1] and pid_t is not None and previous_end < pid_t < start:
                start = pid_t
            if index == indices[0] and launched:
                start = min(start, launched[0])
        previous_end = mine[-1]["t"]
        if startup is not None and "restore_s" in startup.get("phases", {}):
            restore_s = float(startup["phases"]["restore_s"])
        else:
            restore_s = _restore_s(restores, index)
        out[index] = Incarnation(index, start, restore_s)
    return out


def _restore_s(restores: list[dict[str, Any]], index: int) -> float:
    """The slowest rank's restore of incarnation ``index`` (a fresh start loads nothing)."""
    if any("incarnation" in e for e in restores):
        mine = [e for e in restores if e.get("incarnation") == index]
    else:
        rank0 = [e for e in restores if e.get("rank", 0) == 0]
        mine = rank0[index : index + 1]
    return max((float(e.get("seconds", 0.0)) for e in mine if e.get("source") != "fresh"), default=0.0)


def _nth(events: list[dict[str, Any]], index: int) -> dict[str, Any] | None:
    """The event of incarnation ``index``: by its ``incarnation`` field, else the index-th one."""
    if any("incarnation" in e for e in events):
        return next((e for e in events if e.get("incarnation") == index), None)
    return events[index] if index < len(events) else None


def _attach_quorum(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """Replica groups: each committed row's ``quorum_s`` from its ``step`` event (in commit order)."""
    pending: dict[int, list[float]] = {}
    for e in events:
        if e.get("event") == "step" and e.get("committed"):
            pending.setdefault(e["step"], []).append(float(e.get("quorum_s", 0.0)))
    for row in rows:
        queue = pending.get(row["step"])
        if queue and "quorum_s" not in row:
            row["quorum_s"] = queue.pop(0)


def group_goodput(run: RunData, group: GroupRun) -> dict[str, Any]:
    """:func:`resilient.chaos.accounting.run_goodput` of one group, from launch to its last record."""
    commits = [
        Commit(
            t=float(r["t"]),
            step=int(r["step"]),
            incarnation=int(r["incarnation"]),
            ckpt_stall_s=float(r.get("ckpt_stall_s", 0.0)),
            data_wait_s=float(r.get("data_wait_s", 0.0)),
            quorum_s=float(r.get("quorum_s", 0.0)),
        )
        for r in group.metrics
    ]
    t_launch = group.t_launch if group.t_launch is not None else 0.0
    done = [e["t"] for e in run.events if e.get("event") == "done" and e.get("group", 0) == group.group]
    t_end = max([c.t for c in commits] + (done if group.timing == "recorded" else []), default=t_launch)
    return run_goodput(commits, group.incarnations, t_launch, t_end, held_spans(run.holds))
