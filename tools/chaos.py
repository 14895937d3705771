"""``resilient-chaos``: prove a job survives faults.

    resilient-chaos run chaos/scenarios/smoke.toml [--report DIR] [--seed N] [--cache DIR] [--debug]
    resilient-chaos run smoke                      # a scenario under chaos/scenarios/ by name
    resilient-chaos list

``run`` starts the scenario's job through ``resilient-train --replica-groups``, injects its faults,
runs (or reuses from the cache) the fault-free twin, checks the invariants, writes
``DIR/report.json`` and ``DIR/timeline.png``. Thin by design: the logic lives in ``resilient.chaos``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from resilient.tools.cli import OneLineParser, one_line

PROG = "resilient-chaos"

EXIT_CODES = """exit codes of `run`:
  0  every invariant holds
  1  an invariant failed (report.json names it, with its reason)
  2  bad scenario, recipe override or arguments
  3  the harness itself crashed (report.json has "harness_error" with the traceback, when the report
     directory could be written), or the disk is full"""
EXIT_PASSED, EXIT_FAILED, EXIT_CONFIG, EXIT_CRASH = 0, 1, 2, 3


def _crashed(error: BaseException, *, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(
        f"{PROG}: error: the harness crashed before it could write a report: {type(error).__name__}: "
        f"{one_line(error)} (rerun with --debug)",
        file=sys.stderr,
    )
    return EXIT_CRASH


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of a crash of the harness")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a scenario, check its invariants, write the report",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("scenario", help="a scenario .toml, or the name of one under chaos/scenarios/")
    run.add_argument("--report", default="", help="report directory (default: runs/chaos/<scenario>)")
    run.add_argument("--seed", type=int, default=None, help="seed of the random faults (default: [job] seed)")
    run.add_argument(
        "--cache", default="", help="twin cache (default: $RESILIENT_CHAOS_CACHE or ~/.cache/resilient-chaos)"
    )
    # SUPPRESS: the subcommand's default must not overwrite a --debug given before it.
    run.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub.add_parser("list", help="the scenarios under chaos/scenarios/")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from resilient.chaos.scenario import list_scenarios, load_scenario
    from resilient.errors import ConfigError, disk_full

    if args.command == "list":
        for name in list_scenarios():
            print(name)
        return 0
    from resilient.chaos.harness import run_scenario

    try:
        scenario = load_scenario(args.scenario, seed=args.seed)
        report_dir = args.report or os.path.join("runs", "chaos", scenario.name)
        report = run_scenario(scenario, report_dir, cache_dir=args.cache or None)
    except ConfigError as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        if not disk_full(e):
            return _crashed(e, debug=args.debug)
        print(f"{PROG}: error: the disk is full: {one_line(e)}; free space and run again", file=sys.stderr)
        return EXIT_CRASH  # not 1 (an invariant failed) nor 2 (bad input): the machine's
    except Exception as e:  # noqa: BLE001 (a crash must not exit 1, which means "an invariant failed")
        return _crashed(e, debug=args.debug)
    where = os.path.join(report_dir, "report.json")
    if "harness_error" in report:
        if args.debug:
            print(report["harness_error"]["traceback"], file=sys.stderr)
        print(
            f"{scenario.name}: HARNESS CRASHED ({report['harness_error']['type']}: "
            f"{one_line(report['harness_error']['message'])}); report in {where} (its traceback too)",
            file=sys.stderr,
        )
        return EXIT_CRASH
    verdict = (
        "PASSED"
        if report["passed"]
        else "FAILED: " + ", ".join(name for name, v in report["invariants"].items() if not v["ok"])
    )
    print(f"{scenario.name}: {verdict}; report in {where}")
    return EXIT_PASSED if report["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
