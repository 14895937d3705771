"""``resilient-report``: where a run's time went.

    resilient-report RUN_DIR [--out DIR] [--debug]

Reads what the run recorded (docs/observability.md; older runs without the issue-16 fields too)
and writes ``report.html`` (one self-contained page: every figure an inline PNG) and
``summary.json`` (goodput by cause, step time percentiles, stragglers, hangs, incarnations,
diagnoses) into DIR (default: RUN_DIR). Exit codes: 0 written; 2 a missing or unreadable RUN_DIR,
an unwritable DIR or a usage error, one line on stderr (a traceback only with --debug).
Thin by design: reading is report_data, numbers report_summary, the page report_html.
"""

from __future__ import annotations

import json
import os
import sys

from resilient.errors import disk_full
from resilient.tools.cli import OneLineParser, run_command

PROG = "resilient-report"


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 ok, 1 a full disk, 2 usage, input or access error, 141 its reader went away (| head)",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of a training run")
    parser.add_argument("--out", default="", metavar="DIR", help="where to write report.html and summary.json")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    return parser


def write_report(run_dir: str, out_dir: str) -> dict:
    """Read ``run_dir``, write ``summary.json`` and ``report.html`` into ``out_dir``; returns the summary."""
    from resilient.tools.report_data import ReportError, load_run
    from resilient.tools.report_html import render
    from resilient.tools.report_summary import summarize

    run = load_run(run_dir)
    summary = summarize(run)
    page = render(run, summary)
    try:
        os.makedirs(out_dir, exist_ok=True)
        for name, text in (("summary.json", json.dumps(summary, indent=1, default=str) + "\n"), ("report.html", page)):
            tmp = os.path.join(out_dir, f".{name}.tmp{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(out_dir, name))
    except OSError as e:
        if disk_full(e):
            raise
        raise ReportError(
            f"cannot write the report into {out_dir} ({e.strerror or e}); pass --out DIR, a writable one"
        ) from e
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return int(e.code or 0)
    from resilient.tools.report_data import ReportError

    out_dir = args.out or args.run_dir
    return run_command(PROG, lambda: _report(args.run_dir, out_dir), debug=args.debug, expected=(ReportError, OSError))


def _report(run_dir: str, out_dir: str) -> int:
    summary = write_report(run_dir, out_dir)
    good = summary["goodput"]
    print(
        f"{PROG}: {summary['steps']} steps, goodput {good['goodput']:.1%} of {good['total_s']:.1f} s; "
        f"{len(summary['diagnoses'])} diagnosis(es); {os.path.join(out_dir, 'report.html')}"
    )
    for line in summary["diagnoses"]:
        print(f"  - {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
