"""``resilient-chaos``: prove a job survives faults.

    resilient-chaos run chaos/scenarios/smoke.toml [--report DIR] [--seed N] [--cache DIR]
    resilient-chaos run smoke                      # a scenario under chaos/scenarios/ by name
    resilient-chaos list

``run`` starts the scenario's job through ``resilient-train --replica-groups``, injects its faults,
runs (or reuses from the cache) the fault-free twin, checks the invariants, writes
``DIR/report.json`` and ``DIR/timeline.png``, and exits 0 only if every invariant holds (1 if one
fails, 2 on a bad scenario or arguments). Thin by design: the logic lives in ``resilient.chaos``.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="resilient-chaos", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario, check its invariants, write the report")
    run.add_argument("scenario", help="a scenario .toml, or the name of one under chaos/scenarios/")
    run.add_argument("--report", default="", help="report directory (default: runs/chaos/<scenario>)")
    run.add_argument("--seed", type=int, default=None, help="seed of the random faults (default: [job] seed)")
    run.add_argument("--cache", default="",
                     help="twin cache (default: $RESILIENT_CHAOS_CACHE or ~/.cache/resilient-chaos)")
    sub.add_parser("list", help="the scenarios under chaos/scenarios/")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from resilient.chaos.scenario import list_scenarios, load_scenario
    from resilient.errors import ConfigError

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
        print(f"error: {e}", file=sys.stderr)
        return 2
    verdict = "PASSED" if report["passed"] else "FAILED: " + ", ".join(
        name for name, v in report["invariants"].items() if not v["ok"])
    print(f"{scenario.name}: {verdict}; report in {os.path.join(report_dir, 'report.json')}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
