"""What each fault cost, read back from the job's ``events.jsonl``, and goodput by cause.

Per fault (t_f: the moment it hit, pre: the highest step the job had committed by then):

- ``detected_s``: until the job reacted — the first failed commit vote, restart (``joining``),
  ``lighthouse_exited`` or restore after t_f;
- ``recovered_s``: until the job is back to what it was: it commits a step past ``pre`` AND every
  group the fault took down commits again (its restart healed or restored);
- ``steps_lost``: steps whose work was thrown away — distinct steps whose commit vote failed, plus
  ``pre - r`` when the job rolled back to step r (every group restored from storage or RAM);
- ``restore_source``: the RAM tier's ``restore`` events of the hit groups (own / buddy /
  persistent / peer / fresh), else the ``start`` events' source (peer or persistent).

Goodput splits the job's wall time. Each fault opens a stall window [t_f, first commit past pre];
inside it: detect (t_f to detection), reload (restore/heal load time the job waited for), replay
(recommitting steps it had already committed), reconfigure (the rest: new quorum, restarts).
Outside windows, time between the first and last commit is productive; before the first commit is
startup. Time the harness held the live groups (``job.hold_at_step``) is reported as ``held_s`` and
left out of ``total_s``: it is the harness's, not the job's. The frame (total, held, startup,
shutdown) and the interval arithmetic are ``accounting``'s, shared with ``resilient-report``'s
goodput of runs without injected faults.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from resilient.chaos.accounting import committed_events as _commits
from resilient.chaos.accounting import frame, held_spans
from resilient.chaos.accounting import overlap as _overlap
from resilient.chaos.accounting import union as _union
from resilient.chaos.inject import FaultRecord
from resilient.chaos.scenario import NO_DOWNTIME_KINDS

_DETECT_EVENTS = {"joining", "lighthouse_exited", "restore"}


def _rolled_back_to(events: list[dict[str, Any]], t0: float, t1: float, pre: int) -> int | None:
    steps = [
        e["step"]
        for e in events
        if t0 < e["t"] <= t1
        and (
            (e.get("event") == "start" and e.get("source") == "persistent")
            or (e.get("event") == "restore" and e.get("source") not in (None, "peer"))
        )
    ]
    low = min(steps, default=None)
    return low if low is not None and low < pre else None


def _full_strength(
    record: FaultRecord, events: list[dict[str, Any]], commits: list[dict[str, Any]], t_back: float | None
) -> float | None:
    """When the job is at full strength again: every group the fault took down commits after its
    rejoin attempt joined (None: some group never did)."""
    t_full = t_back
    for group, attempt in record.rejoin.items():
        joined = min(
            (
                e["t"]
                for e in events
                if e.get("event") == "joining" and e.get("group") == group and e.get("attempt", 0) >= attempt
            ),
            default=None,
        )
        back = (
            None if joined is None else next((e["t"] for e in commits if e["group"] == group and e["t"] > joined), None)
        )
        t_full = None if back is None or t_full is None else max(t_full, back)
    return t_full


def fault_costs(record: FaultRecord, events: list[dict[str, Any]]) -> dict[str, Any]:
    t_f = record.t_injected
    out: dict[str, Any] = {
        "kind": record.spec.kind,
        "at_step": record.at_step,
        "planned": record.spec.describe(),
        "state": record.state,
        "detected_s": None,
        "recovered_s": None,
        "steps_lost": 0,
        "restore_source": None,
        "note": record.note,
        "injected_t": t_f,
        **record.extra,
    }
    if record.killed:
        out["killed"] = record.killed
    if record.spec.expect_restore_source is not None:
        out["restore_check"] = restore_check(record, events)
    # Not a crash: nothing to detect or recover from (S3 trouble is retried inside the saves; its
    # cost shows as checkpoint stall in metrics.jsonl, not as a stall of the job).
    if t_f is None or record.spec.kind in NO_DOWNTIME_KINDS:
        return out
    commits = _commits(events)
    pre = max((e["step"] for e in commits if e["t"] < t_f), default=0)
    t_back = next((e["t"] for e in commits if e["t"] > t_f and e["step"] > pre), None)
    hit = set(record.rejoin)
    # The job noticed: a failed vote, a quorum with fewer groups than just before, a restart, ...
    width = next((e["participants"] for e in reversed(commits) if e["t"] < t_f), None)
    detect = [
        e["t"]
        for e in events
        if e["t"] > t_f
        and (
            (e.get("event") == "step" and (not e.get("committed") or (width and e.get("participants", width) < width)))
            or e.get("event") in _DETECT_EVENTS
        )
    ]
    if detect:
        out["detected_s"] = round(min(detect) - t_f, 3)
    t_full = _full_strength(record, events, commits, t_back)
    if t_full is not None:
        out["recovered_s"] = round(t_full - t_f, 3)
    window_end = t_back if t_back is not None else float("inf")
    failed = {
        e["step"] for e in events if e.get("event") == "step" and not e.get("committed") and t_f < e["t"] <= window_end
    }
    # Rolled back only if the job's next commit redid a step (no group trained on through the fault).
    first_after = next((e["step"] for e in commits if e["t"] > t_f), None)
    rolled = _rolled_back_to(events, t_f, window_end, pre) if first_after is not None and first_after <= pre else None
    out["steps_lost"] = len(failed) + (pre - rolled if rolled is not None else 0)
    out["rolled_back_to"] = rolled
    out["pre_fault_step"] = pre
    out["restore_source"] = _restore_source(events, t_f, t_full, hit, record)
    out["_window"] = (t_f, t_back)
    return out


def restore_check(record: FaultRecord, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Did every rank the fault killed restore from ``expect_restore_source``? Each rank's first
    ``restore`` event after the fault hit (every rank writes one per start) is its answer."""
    expected = record.spec.expect_restore_source
    out: dict[str, Any] = {"expected": expected, "got": {}, "ok": False}
    if record.t_injected is None:
        out["reason"] = f"the fault was not injected ({record.state}): no restore to check"
        return out
    restores = sorted(
        (e for e in events if e.get("event") == "restore" and e["t"] > record.t_injected), key=lambda e: e["t"]
    )
    for kill in record.killed:
        if "rank" not in kill:
            continue
        first = next((e for e in restores if e.get("group") == kill["group"] and e.get("rank") == kill["rank"]), None)
        out["got"][f"group{kill['group']}.rank{kill['rank']}"] = first.get("source") if first else None
    wrong = {k: v for k, v in out["got"].items() if v != expected}
    out["ok"] = bool(out["got"]) and not wrong
    if not out["got"]:
        out["reason"] = "the fault killed no rank"
    elif wrong:
        out["reason"] = f"expected every killed rank to restore from {expected!r}; got {wrong} (None: no restore event)"
    return out


def _restore_source(
    events: list[dict[str, Any]], t_f: float, t_full: float | None, hit: set[int], record: FaultRecord
) -> str | None:
    """How the hit groups got their state back, up to their recovery (later restarts are other faults')."""
    if record.spec.kind == "kill_lighthouse":
        return "none: no restart (quorum retried)"
    if not hit:
        return None
    end = t_full if t_full is not None else float("inf")
    events = [e for e in events if t_f < e["t"] <= end and e.get("group") in hit]
    restores = Counter(e.get("source") for e in events if e.get("event") == "restore")
    if restores:
        return "+".join(f"{s}" if n == 1 else f"{s}x{n}" for s, n in sorted(restores.items(), key=str))
    starts = [e.get("source") for e in events if e.get("event") == "start" and e.get("attempt", 0) > 0]
    return "+".join(sorted(set(starts))) if starts else None


def goodput(
    costs: list[dict[str, Any]],
    events: list[dict[str, Any]],
    holds: list[dict[str, Any]],
    t_launch: float,
    t_end: float,
) -> dict[str, float]:
    held = held_spans(holds)
    commits = _commits(events)
    out = {
        "total_s": 0.0,
        "productive_s": 0.0,
        "detect_s": 0.0,
        "reconfigure_s": 0.0,
        "reload_s": 0.0,
        "replay_s": 0.0,
        "startup_s": 0.0,
        "shutdown_s": 0.0,
        "held_s": 0.0,
    }
    t_first, t_last = (commits[0]["t"], commits[-1]["t"]) if commits else (None, None)
    out.update(frame(t_launch, t_end, held, t_first, t_last))
    if not commits:
        return {k: round(v, 3) for k, v in out.items()}
    # Windows in time order, each clipped to start where the previous ones ended: a second inside
    # overlapping stalls is attributed once. (``costs`` are in scenario order, not time order.)
    windows: list[tuple[float, float]] = []
    previous_end = float("-inf")
    timed = sorted((c for c in costs if c.get("_window") and c["_window"][1] is not None), key=lambda c: c["_window"])
    for cost in timed:
        t_f, t_back = max(cost["_window"][0], previous_end), cost["_window"][1]
        if t_back <= t_f:
            continue
        previous_end = t_back
        windows.append((t_f, t_back))
        stall = t_back - t_f - _overlap((t_f, t_back), held)
        # Detection is timed from the fault; a clipped window starts later, so less of it is detecting.
        detect = min(stall, max(0.0, cost["_window"][0] + (cost["detected_s"] or 0.0) - t_f))
        reload = min(stall - detect, _reload_s(events, t_f, t_back))
        replay = min(stall - detect - reload, _replay_s(commits, t_f, t_back, cost))
        out["detect_s"] += detect
        out["reload_s"] += reload
        out["replay_s"] += replay
        out["reconfigure_s"] += max(0.0, stall - detect - reload - replay)
    busy = t_last - t_first - _overlap((t_first, t_last), _union(windows + held))
    first_step = min(commits, key=lambda e: e["step"])
    out["productive_s"] = max(0.0, busy)
    out["startup_s"] = max(0.0, out["startup_s"])
    out["goodput"] = out["productive_s"] / out["total_s"] if out["total_s"] else 0.0
    out["first_commit_step"] = first_step["step"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def _reload_s(events: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Load time the job waited for inside a stall: RAM/storage restore seconds, else joining->start
    of a restart that restored from storage (a peer heal of a rejoining group stalls nobody)."""
    restores = [e.get("seconds", 0.0) for e in events if e.get("event") == "restore" and t0 < e["t"] <= t1]
    if restores:
        return float(max(restores))
    total = 0.0
    storage_starts = [e for e in events if e.get("event") == "start" and e.get("source") == "persistent"]
    for start in (e for e in storage_starts if t0 < e["t"] <= t1):
        joined = max(
            (
                e["t"]
                for e in events
                if e.get("event") == "joining" and e.get("group") == start["group"] and e["t"] <= start["t"]
            ),
            default=start["t"],
        )
        total = max(total, start["t"] - joined)
    return total


def _replay_s(commits: list[dict[str, Any]], t0: float, t1: float, cost: dict[str, Any]) -> float:
    rolled = cost.get("rolled_back_to")
    if rolled is None:
        return 0.0
    redo = [e["t"] for e in commits if t0 < e["t"] <= t1 and rolled < e["step"] <= cost["pre_fault_step"]]
    return max(redo) - min(redo) if redo else 0.0
