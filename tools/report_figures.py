"""The figures of ``report.html``, each a PNG (matplotlib, Agg) returned as bytes.

Time axes are seconds since the run's launch (the first incarnation's process start); every group
is drawn in its own colour, incarnation boundaries as dashed vertical lines.
"""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, no GUI backend probing
import matplotlib.pyplot as plt  # noqa: E402

from resilient.tools.report_data import RunData  # noqa: E402
from resilient.tools.report_summary import RANK_PHASES, rank_lateness, rank_means  # noqa: E402

DPI = 100
_PHASE_COLOURS = dict(
    zip(RANK_PHASES, ("tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown"), strict=True)
)


def t0_of(run: RunData) -> float:
    return min(g.t_launch for g in run.groups.values() if g.t_launch is not None)


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return buffer.getvalue()


def _boundaries(ax: Any, run: RunData, t0: float, label: bool) -> None:
    for group in run.groups.values():
        for index, inc in sorted(group.incarnations.items()):
            if index == min(group.incarnations):
                continue
            ax.axvline(inc.start_t - t0, color="grey", ls="--", lw=1)
            if label:
                ax.annotate(
                    f"g{group.group} inc {index}", (inc.start_t - t0, 1.0), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=7, color="dimgrey",
                )  # fmt: skip


def training_curves(run: RunData) -> bytes:
    """Loss, throughput (tokens/s) and MFU per committed step against time."""
    t0 = t0_of(run)
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True)
    for ax, key, label in zip(axes, ("loss", "tokens_per_s", "mfu"), ("loss", "tokens/s", "MFU"), strict=True):
        for colour, group in enumerate(run.groups.values()):
            scale = 100.0 if key == "mfu" else 1.0
            for index in sorted(group.incarnations):  # one line per incarnation: no line across a restart
                rows = [r for r in group.metrics if r.get(key) is not None and r["incarnation"] == index]
                times, values = [r["t"] - t0 for r in rows], [r[key] * scale for r in rows]
                legend = f"group {group.group}" if index == min(group.incarnations) else None
                ax.plot(times, values, "-o", ms=3, color=f"C{colour}", label=legend)
        ax.set_ylabel(f"{label} (%)" if key == "mfu" else label)
        ax.grid(alpha=0.3)
        _boundaries(ax, run, t0, label=key == "loss")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[0].set_title("training curves (dashed: a new incarnation starts)", fontsize=10)
    synthesized = "  (synthesized from step times)" if run.timing != "recorded" else ""
    axes[-1].set_xlabel(f"seconds since launch{synthesized}")
    return _png(fig)


def rank_breakdown(run: RunData) -> bytes | None:
    """Each rank's mean step, stacked by phase (``group<G>/ranks.jsonl``); None without that file."""
    bars = [(f"g{g.group} r{rank}", means) for g in run.groups.values() for rank, means in rank_means(g).items()]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 1.8))
    labels = [label for label, _ in bars]
    left = [0.0] * len(bars)
    for phase in RANK_PHASES:
        widths = [means[phase] * 1000 for _, means in bars]
        ax.barh(labels, widths, left=left, color=_PHASE_COLOURS[phase], label=phase.removesuffix("_s"))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per step")
    ax.set_title("per-rank step breakdown (ranks.jsonl)", fontsize=10)
    ax.legend(fontsize=8, ncols=len(RANK_PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.08))
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def rank_lateness_plot(run: RunData, summary: dict[str, Any]) -> bytes | None:
    """Per rank and window: its stalled time (held from outside) as a share of the step, and its
    arrival lateness at the window's sync point; straggler episodes shaded. None without them."""
    series = [(g, rank, rows) for g in run.groups.values() for rank, rows in rank_lateness(g).items()]
    if not series:
        return None
    step_s = {
        (g.group, int(w["step"])): max(float(r.get("step_s", 0.0)) for r in w.get("ranks", [{}]))
        for g in run.groups.values()
        for w in g.ranks
    }
    fig, (held, late) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for index, (group, rank, rows) in enumerate(series):
        steps = [step for step, _, _ in rows]
        shares = [100 * stalled / max(step_s.get((group.group, step), 0.0), 1e-9) for step, stalled, _ in rows]
        label = f"g{group.group} r{rank}"
        held.plot(steps, shares, "-o", ms=3, color=f"C{index}", label=label)
        late.plot(steps, [1e3 * lateness for _, _, lateness in rows], "-o", ms=3, color=f"C{index}", label=label)
    for s in summary["stragglers"]:
        end = (
            s["cleared_step"]
            if s.get("cleared_step") is not None
            else max(max(st for st, _, _ in r) for *_, r in series)
        )
        for ax in (held, late):
            ax.axvspan(s["step"], end, color="tab:orange", alpha=0.15)
        who = f"g{s['group']}" + ("" if s["rank"] is None else f" r{s['rank']}")
        held.annotate(f"{who} {s['phase']}", (s["step"], 1.0), xycoords=("data", "axes fraction"),
                      va="top", fontsize=7)  # fmt: skip
    held.set_ylabel("stalled, % of step")
    late.set_ylabel("late at sync, ms")
    late.set_xlabel("step (end of each ranks.jsonl window; shaded: a straggler episode)")
    held.set_title("per-rank stalled time and lateness (ranks.jsonl)", fontsize=10)
    held.legend(fontsize=8, ncols=min(len(series), 8), loc="upper right")
    for ax in (held, late):
        ax.grid(alpha=0.3)
    return _png(fig)


def _save_times(run: RunData) -> list[tuple[float, float, str]]:
    """Each save as (start, seconds, outcome): its ``t`` when recorded (the record is written when
    the save ends), else its step's commit time (older runs)."""
    out = []
    for group in run.groups.values():
        commit_t = {r["step"]: r["t"] for r in group.metrics}
        for s in group.saves:
            seconds = float(s.get("total_s", 0.0))
            if "t" in s:
                start = float(s["t"]) - seconds
            elif s.get("step") in commit_t:
                start = commit_t[s["step"]]
            else:
                continue
            out.append((start, seconds, str(s.get("outcome", "committed"))))
    return out


def timeline(run: RunData, summary: dict[str, Any]) -> bytes:
    """Commits, saves, restores, stragglers and hangs of the run on one time axis."""
    t0 = t0_of(run)
    rows = ["commits", "saves", "restores", "stragglers", "hangs"]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for group in run.groups.values():
        times = [r["t"] - t0 for r in group.metrics]
        ax.plot(times, [0] * len(times), "|", ms=12, label=f"group {group.group}")
    for start, seconds, outcome in _save_times(run):
        colour = "tab:green" if outcome == "committed" else "tab:red"
        ax.plot([start - t0, start - t0 + max(seconds, 1e-3)], [1, 1], color=colour, lw=6, solid_capstyle="butt")
    for r in summary["restores"]:
        if "t" in r:
            ax.plot(r["t"] - t0, 2, "D", color="tab:purple", ms=6)
            ax.annotate(str(r.get("source", "")), (r["t"] - t0, 2.2), fontsize=7, ha="center")
    for e in run.events:
        if e.get("event") == "straggler" and "t" in e:
            ax.plot(e["t"] - t0, 3, "v", color="tab:orange", ms=7)
            who = f"g{e.get('group')}" if e.get("rank") is None else f"r{e.get('rank')}"
            ax.annotate(who, (e["t"] - t0, 3.2), fontsize=7, ha="center")
        elif e.get("event") == "hang" and "t" in e:
            ax.plot(e["t"] - t0, 4, "X", color="tab:red", ms=8)
            ax.annotate(f"r{e.get('rank')}", (e["t"] - t0, 4.2), fontsize=7, ha="center")
    _boundaries(ax, run, t0, label=False)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel("seconds since launch  (saves: green committed, red failed; restores: source)")
    ax.set_title("timeline", fontsize=10)
    return _png(fig)


def goodput_bars(goodput: dict[str, Any]) -> bytes:
    """Seconds per cause, labelled with their share of the run."""
    causes = [(c.removesuffix("_s"), v) for c, v in goodput["causes"].items()]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    colours = ["tab:green" if name == "productive" else "tab:red" for name, _ in causes]
    bars = ax.bar([name for name, _ in causes], [v["seconds"] for _, v in causes], color=colours)
    for bar, (_, v) in zip(bars, causes, strict=True):
        ax.annotate(f"{v['fraction']:.1%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("seconds")
    ax.set_title(f"goodput by cause: {goodput['goodput']:.1%} of {goodput['total_s']:.1f} s productive", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)
