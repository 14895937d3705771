"""``report.html``: one self-contained page (figures inlined as base64 PNGs, styles inline, no
external reference) so the file can be mailed, attached to an issue or opened offline."""

from __future__ import annotations

import base64
import html
from typing import Any

from resilient.tools import report_figures as figures
from resilient.tools.report_cadence import cadence_html
from resilient.tools.report_data import RunData

_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-size: 13px; }
th { background: #f2f2f2; }
img { max-width: 100%; border: 1px solid #eee; margin-bottom: 1em; }
.bad { color: #b00; }
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def render(run: RunData, summary: dict[str, Any]) -> str:
    good = summary["goodput"]
    parts = [
        f"<h1>run {html.escape(str(summary['run_id'] or '(no run id)'))}</h1>",
        f"<p>{html.escape(summary['run_dir'])}: {summary['steps']} steps, groups {summary['groups']}, "
        f"{summary['incarnations']['count']} incarnation(s); goodput <b>{good['goodput']:.1%}</b> of "
        f"{good['total_s']:.1f} s (group {good['group']}); timing {summary['timing']}</p>",
        "<h2>Diagnoses</h2>",
        "<ul>" + "".join(f'<li class="bad">{html.escape(d)}</li>' for d in summary["diagnoses"]) + "</ul>"
        if summary["diagnoses"]
        else "<p>nothing stands out</p>",
        "<h2>Slowest phases</h2>",
        _table(
            ["phase", "seconds", "share of run", "diagnosis"],
            [[p["phase"], p["seconds"], f"{p['fraction_of_run']:.1%}", p["diagnosis"]] for p in summary["phases"]],
        ),
        "<h2>Goodput by cause</h2>",
        _img(figures.goodput_bars(good), "goodput by cause"),
        _table(
            ["cause", "seconds", "share"],
            [[c, v["seconds"], f"{v['fraction']:.1%}"] for c, v in good["causes"].items()],
        ),
        "<h2>Step time</h2>",
        _table(["p50", "p90", "p99", "mean", "steps"], [[*summary["step_time"].values()]]),
        "<h2>Training curves</h2>",
        _img(figures.training_curves(run), "loss, throughput and MFU"),
        "<h2>Per-rank step breakdown</h2>",
    ]
    breakdown = figures.rank_breakdown(run)
    parts.append(_img(breakdown, "per-rank step breakdown") if breakdown else "<p>no ranks.jsonl in this run</p>")
    parts += [
        *_stragglers(run, summary),
        "<h2>Timeline: saves, restores, stragglers, hangs</h2>",
        _img(figures.timeline(run, summary), "timeline"),
        cadence_html(run, summary.get("cadence"), figures.t0_of(run)),
        *_run_tables(summary),
    ]
    body = "\n".join(parts)
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>resilient-report '
        f"{html.escape(str(summary['run_id']))}</title><style>{_STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def _stragglers(run: RunData, summary: dict[str, Any]) -> list[str]:
    """The per-rank stalled time and lateness plot, and one row per straggler episode."""
    lateness = figures.rank_lateness_plot(run, summary)
    headers = ["group", "rank", "reason", "ratio", "from step", "to step", "steps", "ms a step", "peers ms"]
    headers += ["stalled ms", "peers stalled ms", "late ms", "peers late ms"]
    return [
        "<h2>Stragglers</h2>",
        _img(lateness, "per-rank stalled time and lateness") if lateness else "",
        _table(headers, [_straggler_row(s) for s in summary["stragglers"]]),
    ]


def _straggler_row(s: dict[str, Any]) -> list[Any]:
    def ms(key: str) -> float | None:
        return None if s.get(key) is None else 1e3 * float(s[key])

    cleared = s.get("cleared_step")
    return [
        s["group"], s["rank"], s["phase"], s["ratio"], s["step"], "end" if cleared is None else cleared,
        s.get("duration_steps"), ms("value_s"), ms("median_s"), ms("stalled_s"), ms("median_stalled_s"),
        ms("late_s"), ms("median_late_s"),
    ]  # fmt: skip


def _run_tables(summary: dict[str, Any]) -> list[str]:
    """Hangs, incarnations and saves, as tables."""
    return [
        "<h3>Hangs</h3>",
        _table(["group", "rank", "step", "idle s", "stacks"], [[h[k] for k in list(h)[1:]] for h in summary["hangs"]]),
        "<h3>Incarnations</h3>",
        _table(
            ["group", "incarnation", "steps", "first step", "last step", "restore s", "seconds"],
            [
                [
                    i["group"],
                    i["incarnation"],
                    i["steps"],
                    i["first_step"],
                    i["last_step"],
                    i["restore_s"],
                    i["end_t"] - i["start_t"],
                ]
                for i in summary["incarnations"]["list"]
            ],
        ),
        "<h3>Saves</h3>",
        _table(list(summary["saves"]), [[*summary["saves"].values()]]),
    ]
