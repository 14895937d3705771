"""The same faults against another setting: a scenario with ``[check] compare_set`` runs its job
and fault schedule a second time with those overrides, and its run must lose no more work than
that one. Lost work = the steps the faults cost (recomputed, at the run's median step time) plus
every checkpoint stall paid (``ckpt_stall_s`` of every step line, redone steps included): what a
checkpoint cadence trades against each other."""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from typing import Any

from resilient.runfiles import METRICS_FILE, group_file, read_jsonl

SLACK = 1.10
"""How much more lost work than the compare run still passes: two runs on a shared machine differ
in step time by more than the effect of one fault (a verdict on noise would be a coin flip)."""


def lost_work(run_dir: str, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds of work a faulted run lost, from group 0's metrics and the faults' costs."""
    lines = read_jsonl(group_file(run_dir, METRICS_FILE, 0))
    net = [float(r["step_time_s"]) - float(r.get("ckpt_stall_s", 0.0)) for r in lines if "step_time_s" in r]
    step_s = statistics.median(net) if net else 0.0
    steps_lost = sum(int(f.get("steps_lost") or 0) for f in faults)
    stall_s = sum(float(r.get("ckpt_stall_s", 0.0)) for r in lines)
    return {
        "steps_lost": steps_lost,
        "step_s": round(step_s, 4),
        "stall_s": round(stall_s, 4),
        "lost_s": round(steps_lost * step_s + stall_s, 4),
    }


def compare_scenario(scenario: Any) -> Any:
    """The scenario of the comparison run: the same faults, ``compare_set`` on top, no twin (its
    numerics are the first run's: a cadence changes when state is saved, never what it is)."""
    job = replace(scenario.job, set=[*scenario.job.set, *scenario.check.compare_set])
    check = replace(scenario.check, compare_set=[], expect_shorter_ram=False, twin=False)
    return replace(scenario, name=f"{scenario.name}-compare", job=job, check=check)


def no_worse(report: dict[str, Any], compare: dict[str, Any], run_dir: str, compare_dir: str) -> dict[str, Any]:
    """The ``no_worse_than_compare`` verdict, with both runs' lost work."""
    mine = lost_work(run_dir, report.get("faults", []))
    theirs = lost_work(compare_dir, compare.get("faults", []))
    ok = bool(compare.get("passed")) and mine["lost_s"] <= theirs["lost_s"] * SLACK
    reason = (
        f"lost {mine['lost_s']:.2f} s ({mine['steps_lost']} steps recomputed, {mine['stall_s']:.2f} s stalled) "
        f"vs {theirs['lost_s']:.2f} s ({theirs['steps_lost']} steps, {theirs['stall_s']:.2f} s) with "
        f"{compare.get('scenario', {}).get('name', 'the compare setting')}"
        + ("" if compare.get("passed") else "; the compare run itself failed its invariants")
    )
    return {"ok": ok, "reason": reason, "run": mine, "compare": theirs}


def shorter_ram(events: list[dict[str, Any]], memory_every: int) -> dict[str, Any]:
    """The ``ram_interval_shortened`` verdict: some ``cadence`` event set the RAM interval below
    the configured one, after a failure was counted (a startup whose cause is a failure)."""
    failures = [
        e["t"] for e in events if e.get("event") == "startup" and e.get("cause") in ("rank_failed", "node_lost")
    ]
    shorter = [
        e
        for e in events
        if e.get("event") == "cadence" and e.get("tier") == "memory" and e.get("every_steps", 0) < memory_every
    ]
    after = [e for e in shorter if failures and e.get("t", 0) >= min(failures)]
    path = [e.get("every_steps") for e in events if e.get("event") == "cadence" and e.get("tier") == "memory"]
    ok = bool(after)
    return {
        "ok": ok,
        "reason": f"RAM interval {memory_every} -> {path} over the run; {len(failures)} failure start(s)"
        + ("" if ok else ": never shortened after a failure"),
    }


def compare_dir(report_dir: str) -> str:
    return os.path.join(report_dir, "compare")
