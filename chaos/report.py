"""``report.json`` and ``timeline.png``.

The picture has two panels. Top: loss per step of the run (solid) and of its twin (dashed), with a
vertical line at the step each fault hit. Bottom, against wall time since launch: one row per
replica group, a tick for every step it committed (coloured by how many groups took part), faults as
red lines, each fault's recovery as a shaded span (hit to full strength), harness holds in grey.
"""

from __future__ import annotations

import json
import os
from typing import Any

from resilient.chaos.invariants import RunData
from resilient.runfiles import METRICS_FILE


def write_report(path: str, report: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


def _loss(run: RunData) -> dict[int, float]:
    out: dict[int, float] = {}
    for group in range(run.groups):
        out.update({s: r["loss"] for s, r in run.by_step(group, METRICS_FILE).items()})
    return dict(sorted(out.items()))


def write_timeline(
    path: str,
    run: RunData,
    twin: RunData | None,
    costs: list[dict[str, Any]],
    holds: list[dict[str, Any]],
    t_launch: float,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw={"height_ratios": [3, 2]})
    _plot_loss(top, run, twin, costs, title)
    _plot_groups(bottom, run, costs, holds, t_launch)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_loss(top: Any, run: RunData, twin: RunData | None, costs: list[dict[str, Any]], title: str) -> None:
    """Loss per step of the run and of its twin, with a marker per fault."""
    loss = _loss(run)
    top.plot(list(loss), list(loss.values()), "-o", ms=3, label="run (with faults)", color="tab:blue")
    if twin is not None:
        twin_loss = _loss(twin)
        top.plot(list(twin_loss), list(twin_loss.values()), "--", label="fault-free twin", color="tab:orange")
    for cost in costs:
        if cost.get("at_step") is not None:
            top.axvline(cost["at_step"], color="tab:red", alpha=0.6, lw=1)
            top.annotate(
                cost["kind"],
                (cost["at_step"], top.get_ylim()[1]),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color="tab:red",
            )
    top.set_xlabel("step")
    top.set_ylabel("loss")
    top.set_title(title, fontsize=10)
    top.legend(loc="upper right", fontsize=8)


def _plot_groups(
    bottom: Any, run: RunData, costs: list[dict[str, Any]], holds: list[dict[str, Any]], t_launch: float
) -> None:
    """Per group over time: commits, failed votes, joins, fault windows and harness holds."""
    commits = [e for e in run.events if e.get("event") == "step" and e.get("committed")]
    for e in commits:
        bottom.plot(
            [e["t"] - t_launch] * 2,
            [e["group"] - 0.3, e["group"] + 0.3],
            color="tab:green" if e.get("participants") == run.groups else "tab:orange",
            lw=1.2,
        )
    for e in run.events:
        if e.get("event") == "step" and not e.get("committed"):
            bottom.plot(e["t"] - t_launch, e["group"], "x", color="black", ms=5)
        if e.get("event") == "joining":
            bottom.plot(e["t"] - t_launch, e["group"], ">", color="tab:purple", ms=5)
    for cost in costs:
        window = cost.get("_window")
        t_f = window[0] if window else None
        if t_f is None:
            continue
        bottom.axvline(t_f - t_launch, color="tab:red", lw=1)
        if cost.get("recovered_s") is not None:
            bottom.axvspan(t_f - t_launch, t_f - t_launch + cost["recovered_s"], color="tab:red", alpha=0.12)
    for hold in holds:
        if hold.get("event") == "held" and hold.get("seconds", 0) > 0.05:
            start = hold["start"] - t_launch
            bottom.plot([start, start + hold["seconds"]], [hold["group"] + 0.38] * 2, color="grey", lw=3)
    bottom.set_yticks(range(run.groups), [f"group {g}" for g in range(run.groups)])
    bottom.set_ylim(-0.6, run.groups - 0.4)
    bottom.set_xlabel(
        "seconds since launch  (| commit: green = all groups, orange = fewer; x failed vote; "
        "> joining; red = fault, shaded = recovery; grey = harness hold)",
        fontsize=8,
    )
