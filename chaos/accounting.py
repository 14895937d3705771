"""Where a run's wall time went, by cause: the accounting a plain run and the chaos harness share.

Both split the same frame (:func:`frame`): the job's wall time from launch to end, less the seconds
the chaos harness held the live groups (``held_s``: the harness's time, not the job's); before the
first commit is startup, after the last is shutdown. Between them the chaos harness attributes its
fault windows (``analysis.goodput``); a run without injected faults is tiled by its own commits
(:func:`run_goodput`):

- the gap between two commits of one incarnation is that step's wall time: its ``ckpt_stall_s``,
  ``data_wait_s`` and ``quorum_s`` (replica groups) are carved out first, the rest is productive;
  a step committed before (a restart rolled back past it) is replayed as a whole;
- between the last commit of an incarnation and the next one's process start the group was down;
  from that start to its first commit is startup, less the restore (``restore_s``) it waited for.

Every second lands in exactly one cause: the causes sum to ``total_s``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CAUSES = (
    "productive_s",
    "startup_s",
    "restore_s",
    "replay_s",
    "ckpt_stall_s",
    "data_wait_s",
    "quorum_s",
    "down_s",
    "shutdown_s",
)
"""Run-level causes; ``down_s``: between an incarnation's last commit and the next one's start."""


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def committed_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``step`` events whose commit vote passed, in time order."""
    return sorted((e for e in events if e.get("event") == "step" and e.get("committed")), key=lambda e: e["t"])


def held_spans(holds: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The chaos hook's ``held`` records (``<run.dir>/chaos/hook_events.jsonl``) as disjoint spans."""
    return union((h["start"], h["start"] + h["seconds"]) for h in holds if h.get("event") == "held")


def frame(
    t_launch: float, t_end: float, held: list[tuple[float, float]], t_first: float | None, t_last: float | None
) -> dict[str, float]:
    """``total_s`` and ``held_s`` of the wall time; with commits, ``startup_s`` (launch to the first
    commit) and ``shutdown_s`` (the last commit to the end), both without held time."""
    held_s = sum(b - a for a, b in held)
    out = {"total_s": max(0.0, t_end - t_launch - held_s), "held_s": held_s}
    if t_first is None or t_last is None:
        return out
    out["startup_s"] = t_first - t_launch - overlap((t_launch, t_first), held)
    out["shutdown_s"] = max(0.0, t_end - t_last - overlap((t_last, t_end), held))
    return out


@dataclass(slots=True)
class Commit:
    """One committed step of one group, as its ``metrics.jsonl`` row (and quorum event) tell it."""

    t: float
    step: int
    incarnation: int = 0
    ckpt_stall_s: float = 0.0
    data_wait_s: float = 0.0
    quorum_s: float = 0.0


@dataclass(slots=True)
class Incarnation:
    """One start of a group: when its process started and how long its restore kept it waiting."""

    index: int
    start_t: float
    restore_s: float = 0.0


def run_goodput(
    commits: list[Commit],
    incarnations: dict[int, Incarnation],
    t_launch: float,
    t_end: float,
    held: list[tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """Goodput by cause of one group's run (see the module docstring); seconds per cause, the
    fraction of ``total_s`` each is, and ``goodput`` (productive / total)."""
    held = held or []
    commits = sorted(commits, key=lambda c: c.t)
    seconds = dict.fromkeys(CAUSES, 0.0)
    base = frame(t_launch, t_end, held, commits[0].t if commits else None, commits[-1].t if commits else None)
    if not commits:
        seconds["startup_s"] = base["total_s"]
        return _ledger(seconds, base)
    seconds["shutdown_s"] = base["shutdown_s"]
    first = commits[0]
    _startup(seconds, t_launch, first.t, incarnations.get(first.incarnation), held)
    seen = {first.step}
    for prev, cur in zip(commits, commits[1:], strict=False):
        if cur.incarnation != prev.incarnation:
            inc = incarnations.get(cur.incarnation)
            start = min(max(inc.start_t, prev.t), cur.t) if inc else prev.t
            seconds["down_s"] += _free((prev.t, start), held)
            _startup(seconds, start, cur.t, inc, held)
        elif cur.step in seen:
            seconds["replay_s"] += _free((prev.t, cur.t), held)
        else:
            _step(seconds, _free((prev.t, cur.t), held), cur)
        seen.add(cur.step)
    return _ledger(seconds, base)


def _free(span: tuple[float, float], held: list[tuple[float, float]]) -> float:
    return max(0.0, span[1] - span[0] - overlap(span, held))


def _startup(
    seconds: dict[str, float], start: float, t_first: float, inc: Incarnation | None, held: list[tuple[float, float]]
) -> None:
    piece = _free((start, t_first), held)
    restore = min(piece, inc.restore_s) if inc else 0.0
    seconds["restore_s"] += restore
    seconds["startup_s"] += piece - restore


def _step(seconds: dict[str, float], piece: float, commit: Commit) -> None:
    """A step's wall time: its stalls first (each at most what is left), the rest was training."""
    left = piece
    for cause in ("ckpt_stall_s", "data_wait_s", "quorum_s"):
        part = min(left, max(0.0, getattr(commit, cause)))
        seconds[cause] += part
        left -= part
    seconds["productive_s"] += left


def _ledger(seconds: dict[str, float], base: dict[str, float]) -> dict[str, Any]:
    total = base["total_s"]
    return {
        "total_s": round(total, 6),
        "held_s": round(base["held_s"], 6),
        "goodput": round(seconds["productive_s"] / total, 6) if total else 0.0,
        "causes": {
            cause: {"seconds": round(s, 6), "fraction": round(s / total, 6) if total else 0.0}
            for cause, s in seconds.items()
        },
    }
