"""``summary.json`` of ``resilient-report``: goodput by cause, step time, stragglers, hangs,
incarnations and saves of a run, and one diagnosis line per slow phase with what to change."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from resilient.tools.report_cadence import cadence_summary
from resilient.tools.report_data import GroupRun, RunData, group_goodput

RANK_PHASES = ("data_wait_s", "compute_s", "grad_sync_s", "optimizer_s", "ckpt_stall_s", "snapshot_s")
DIAGNOSE_AT = 0.05
"""A cause worth a diagnosis: at least this fraction of the run (or, for stalls, of step time)."""
STARTUP_AT = 0.20
"""Startup is expected to cost something; it is named from this fraction of the run."""

_ADVICE = {
    "ckpt_stall_s": 'raise checkpoint.persist_every or use checkpoint.writer="process"',
    "data_wait_s": "raise data.num_workers (or data.prefetch_factor)",
    "startup_s": "fewer restarts, or a longer run per start",
    "restore_s": "turn on the RAM tier (checkpoint.memory_every) so a restart reloads from memory",
    "replay_s": "lower checkpoint.persist_every or turn on checkpoint.memory_every: a restart redoes fewer steps",
    "quorum_s": "a replica group is slow or rejoining: compare the groups' step times",
    "down_s": "events.jsonl says why each restart happened (group_exited, lighthouse_exited, a kill)",
    "shutdown_s": "the final save and teardown are slow: check saves.jsonl",
}
_NAMES = {
    "ckpt_stall_s": "checkpoint stall",
    "data_wait_s": "data wait",
    "startup_s": "startup",
    "restore_s": "restore",
    "replay_s": "replayed steps",
    "quorum_s": "waiting for quorum",
    "down_s": "downtime between incarnations",
    "shutdown_s": "shutdown",
}


def summarize(run: RunData) -> dict[str, Any]:
    primary = run.groups[min(g for g, r in run.groups.items() if r.metrics)]
    good = group_goodput(run, primary)
    rows = [r for g in run.groups.values() for r in g.metrics]
    out: dict[str, Any] = {
        "run_id": run.run_id,
        "run_dir": run.run_dir,
        "timing": run.timing,
        "groups": sorted(g for g, r in run.groups.items() if r.metrics),
        "steps": max(r["step"] for r in rows),
        "goodput": {**good, "group": primary.group},
        "step_time": step_time([float(r.get("step_time_s", 0.0)) for r in rows]),
        "throughput": _throughput(primary.metrics),
        "incarnations": incarnations(run),
        "stragglers": stragglers(run),
        "hangs": hangs(run),
        "saves": saves(primary),
        "restores": restores(run),
        "startups": [e for e in run.events if e.get("event") == "startup"],
        "cadence": cadence_summary(run),
    }
    if len(out["groups"]) > 1:
        out["goodput_by_group"] = {str(g): group_goodput(run, run.groups[g]) for g in out["groups"]}
    out["phases"] = slow_phases(good, primary.metrics, out["startups"])
    out["diagnoses"] = diagnoses(out)
    return out


def step_time(values: list[float]) -> dict[str, float]:
    """Percentiles (linear interpolation between closest ranks, numpy's default) and the mean."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "count": 0}
    p50, p90, p99 = (round(float(v), 6) for v in np.percentile(values, [50, 90, 99]))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": round(statistics.fmean(values), 6), "count": len(values)}


def _throughput(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    def mean(key: str) -> float | None:
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        return round(statistics.fmean(values), 6) if values else None

    return {"tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu")}


def incarnations(run: RunData) -> dict[str, Any]:
    listed = []
    for group in run.groups.values():
        for index, inc in sorted(group.incarnations.items()):
            rows = [r for r in group.metrics if r["incarnation"] == index]
            listed.append(
                {
                    "group": group.group,
                    "incarnation": index,
                    "start_t": round(inc.start_t, 4),
                    "end_t": round(rows[-1]["t"], 4),
                    "steps": len(rows),
                    "first_step": rows[0]["step"],
                    "last_step": rows[-1]["step"],
                    "restore_s": round(inc.restore_s, 6),
                }
            )
    return {"count": len(listed), "list": listed}


def rank_means(group: GroupRun) -> dict[int, dict[str, float]]:
    """Each rank's mean per step of every phase over all ``ranks.jsonl`` windows (weighted by ``steps``)."""
    sums: dict[int, dict[str, float]] = {}
    weights: dict[int, float] = {}
    for window in group.ranks:
        steps = float(window.get("steps", 1) or 1)
        for entry in window.get("ranks", []):
            rank = int(entry["rank"])
            acc = sums.setdefault(rank, dict.fromkeys(RANK_PHASES, 0.0))
            for phase in RANK_PHASES:
                acc[phase] += float(entry.get(phase, 0.0)) * steps
            weights[rank] = weights.get(rank, 0.0) + steps
    return {r: {p: v / weights[r] for p, v in acc.items()} for r, acc in sorted(sums.items())}


EVIDENCE = ("value_s", "median_s", "share", "stalled_s", "median_stalled_s", "late_s", "median_late_s", "step_s")
"""What a ``straggler`` event says about why (older events have none of it)."""


def stragglers(run: RunData) -> list[dict[str, Any]]:
    """One entry per straggler episode, in order: the trainer's ``straggler`` event (group, rank,
    phase, ratio, step, its evidence) paired with the ``straggler_cleared`` event that ended it
    (``cleared_step``, ``duration_steps``, ``duration_s``; None while it lasted to the run's end).
    Only the trainer's events: it runs the one detector (``trainer/straggler.StragglerWatch``) on
    the very windows it writes to ``ranks.jsonl``; a second, looser rule here flagged noise."""
    out: list[dict[str, Any]] = []
    open_: dict[tuple[int, int], dict[str, Any]] = {}
    for e in run.events:
        kind = e.get("event")
        if kind not in ("straggler", "straggler_cleared"):
            continue
        rank = e.get("rank")  # None: the whole group, against the other groups
        key = (int(e.get("group", 0)), None if rank is None else int(rank))
        if kind == "straggler":
            entry = {"group": key[0], "rank": key[1], "phase": str(e.get("phase", "step_s"))}
            entry.update(ratio=float(e.get("ratio", 0)), step=e.get("step"), t=e.get("t"), source="event")
            entry.update({k: e[k] for k in EVIDENCE if k in e})
            entry.update(cleared_step=None, duration_steps=None, duration_s=None)
            out.append(entry)
            open_[key] = entry
        elif key in open_:
            entry = open_.pop(key)
            entry.update(cleared_step=e.get("step"), duration_steps=e.get("duration_steps"))
            entry["duration_s"] = e.get("duration_s")
    return out


def rank_lateness(group: GroupRun) -> dict[int, list[tuple[int, float, float]]]:
    """rank -> [(step, stalled seconds per step, arrival lateness in seconds)] over the windows of
    ``ranks.jsonl`` that carry them (runs before the stall clock: empty)."""
    out: dict[int, list[tuple[int, float, float]]] = {}
    for window in group.ranks:
        for entry in window.get("ranks", []):
            if "stalled_s" in entry:
                row = (int(window["step"]), float(entry["stalled_s"]), float(entry.get("late_s", 0.0)))
                out.setdefault(int(entry["rank"]), []).append(row)
    return dict(sorted(out.items()))


def _straggler_why(s: dict[str, Any]) -> str:
    until = f"to step {s['cleared_step']}" if s.get("cleared_step") is not None else "to the end"
    if "value_s" not in s:  # an event from before the evidence fields
        return f"in {s['phase']} ({s['ratio']:.1f}x the median) from step {s['step']}"
    ms = f"{s['value_s'] * 1e3:.0f} ms a step against its peers' {s['median_s'] * 1e3:.0f} ms"
    if s["phase"] == "stalled_s":
        why = f"held from outside {s['share']:.0%} of the step (stalled {ms})"
    else:
        why = f"in {s['phase']} ({s['ratio']:.1f}x the median: {ms})"
    return f"{why} from step {s['step']} {until}"


def hangs(run: RunData) -> list[dict[str, Any]]:
    keys = ("t", "group", "rank", "step", "idle_s", "path")
    return [{k: e.get(k) for k in keys} for e in run.events if e.get("event") == "hang"]


def saves(group: GroupRun) -> dict[str, Any]:
    records = [s for s in group.saves if s.get("event", "save") == "save"]

    def mean(key: str) -> float:
        values = [float(s.get(key, 0.0)) for s in records]
        return round(statistics.fmean(values), 6) if values else 0.0

    outcomes = [s.get("outcome", "committed") for s in records]
    return {
        "count": len(records),
        "committed": outcomes.count("committed"),
        "failed": outcomes.count("failed"),
        "skipped": outcomes.count("skipped"),
        "steps": [s.get("step") for s in records],
        "snapshot_s_mean": mean("snapshot_s"),
        "persist_s_mean": mean("persist_s"),
        "total_s_mean": mean("total_s"),
    }


def restores(run: RunData) -> list[dict[str, Any]]:
    """Each start of a group: the ``start`` event (replica groups) or rank 0's ``restore``."""
    keys = ("t", "group", "step", "source", "seconds", "incarnation")
    starts = [e for e in run.events if e.get("event") == "start"]
    if not starts:
        starts = [e for e in run.events if e.get("event") == "restore" and e.get("rank", 0) == 0]
    return [{k: e[k] for k in keys if k in e} for e in starts]


def slow_phases(
    good: dict[str, Any], rows: list[dict[str, Any]], startups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The non-productive causes, slowest first, each with its share and a one-line diagnosis."""
    step_total = sum(float(r.get("step_time_s", 0.0)) for r in rows)
    out = []
    for cause, entry in good["causes"].items():
        if cause == "productive_s" or entry["seconds"] <= 0:
            continue
        row = {"phase": cause, "seconds": entry["seconds"], "fraction_of_run": entry["fraction"]}
        if cause in ("ckpt_stall_s", "data_wait_s") and step_total > 0:
            row["fraction_of_step_time"] = round(sum(float(r.get(cause, 0.0)) for r in rows) / step_total, 6)
        row["diagnosis"] = _explain(cause, row, startups)
        out.append(row)
    return sorted(out, key=lambda r: -r["seconds"])


def _explain(cause: str, row: dict[str, Any], startups: list[dict[str, Any]]) -> str:
    share = row.get("fraction_of_step_time")
    where = "of step time" if share is not None else "of the run"
    share = row["fraction_of_run"] if share is None else share
    text = f"{_NAMES.get(cause, cause)} is {share:.0%} {where}: {_ADVICE.get(cause, 'see events.jsonl')}"
    if cause == "startup_s" and startups:
        phases: dict[str, float] = {}
        for e in startups:
            for name, seconds in (e.get("phases") or {}).items():
                phases[name] = phases.get(name, 0.0) + float(seconds)
        if phases:
            slowest = max(phases, key=phases.__getitem__)
            text += f" (slowest startup phase: {slowest} {phases[slowest]:.1f} s)"
    return text


def diagnoses(summary: dict[str, Any]) -> list[str]:
    """The phases worth acting on, the stragglers and the hangs, as one line each."""
    out = []
    for row in summary["phases"]:
        share = row.get("fraction_of_step_time", row["fraction_of_run"])
        if share >= (STARTUP_AT if row["phase"] == "startup_s" else DIAGNOSE_AT):
            out.append(row["diagnosis"])
    several = len(summary["groups"]) > 1
    for s in summary["stragglers"]:
        of = f" of group {s['group']}" if several else ""
        who = f"group {s['group']} as a whole" if s["rank"] is None else f"rank {s['rank']}{of}"
        out.append(f"{who} is a straggler {_straggler_why(s)}")
    for h in summary["hangs"]:
        out.append(
            f"rank {h['rank']} of group {h['group']} hung at step {h['step']} "
            f"({h['idle_s'] or 0:.0f} s without a step): stacks in {h['path']}"
        )
    return out
