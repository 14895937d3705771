"""The report's cadence section: each tier's interval over the run with the failures marked, and
the expected waste of the chosen intervals against the fixed setting the run started from (the
``cadence`` events of ``checkpoint.cadence = "adaptive"``; docs/cadence.md)."""

from __future__ import annotations

import io
from typing import Any

from resilient.incarnations import FAILURE_CLASS, start_time
from resilient.tools.report_data import RunData

TIERS = ("memory", "persist")


def cadence_summary(run: RunData) -> dict[str, Any] | None:
    """Interval changes per tier (time, step, every), the failures by cause, and the last expected
    waste against the starting fixed setting's; None when the run never changed an interval."""
    changes = [e for e in run.events if e.get("event") == "cadence"]
    if not changes:
        return None
    out: dict[str, Any] = {"changes": len(changes)}
    for tier in TIERS:
        mine = [e for e in changes if e.get("tier") == tier]
        if mine:
            out[tier] = {
                "start_every": mine[0].get("previous"),
                "final_every": mine[-1].get("every_steps"),
                "points": [[e.get("t"), e.get("step"), e.get("every_steps")] for e in mine],
            }
    last = changes[-1]
    out["expected_waste"] = last.get("waste")
    out["expected_waste_fixed"] = last.get("waste_fixed")
    out["failures"] = [
        {"t": start_time(e), "cause": e.get("cause"), "group": e.get("group")}
        for e in run.events
        if e.get("event") == "startup" and e.get("cause") in FAILURE_CLASS
    ]
    return out


def cadence_figure(run: RunData, summary: dict[str, Any], t0: float) -> bytes:
    """Each tier's interval (steps) against time, a red line at every failure."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5))
    end = max((float(e.get("t", 0.0)) for e in run.events), default=t0)
    for tier, colour in zip(TIERS, ("tab:blue", "tab:green"), strict=True):
        if tier not in summary:
            continue
        points = summary[tier]["points"]
        times = [t0, *(float(p[0]) for p in points), end]
        values = [summary[tier]["start_every"], *(p[2] for p in points), points[-1][2]]
        ax.step([t - t0 for t in times], values, where="post", color=colour, label=f"{tier}_every")
    for failure in summary["failures"]:
        if failure["t"] is not None:
            ax.axvline(failure["t"] - t0, color="tab:red", lw=1, alpha=0.7)
            ax.annotate(failure["cause"], (failure["t"] - t0, 1.0), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=7, color="tab:red")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("interval (steps)")
    ax.legend(loc="lower right")
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def cadence_html(run: RunData, summary: dict[str, Any] | None, t0: float) -> str:
    """The report's section (empty when the cadence never changed)."""
    import base64

    if summary is None:
        return ""
    png = base64.b64encode(cadence_figure(run, summary, t0)).decode()
    waste, fixed = summary.get("expected_waste"), summary.get("expected_waste_fixed")
    line = ""
    if isinstance(waste, int | float) and isinstance(fixed, int | float):
        line = (
            f"<p>expected waste at the chosen intervals {waste:.2%}, at the starting fixed setting {fixed:.2%} "
            f"({summary['changes']} change(s), {len(summary['failures'])} failure(s))</p>"
        )
    return f'<h2>Checkpoint cadence</h2>{line}<img alt="checkpoint cadence" src="data:image/png;base64,{png}">'
