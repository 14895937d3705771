"""What observing a run costs a step (issue 16: <= 1%), measured piece by piece on 2 gloo ranks.

    .venv/bin/python benchmarks/observe_bench.py [--step-s 0.08] [--rank-every 10]

A whole-run A/B cannot resolve 1% on a shared 2-core machine (step times wander by more), so the
added work is timed directly: the per-step bookkeeping (7 phase timers, the commit of a window,
the watchdog's beat) and the all-gather of every rank's phase means every ``rank_every`` steps,
each as the median over many calls, then expressed as a share of a step of ``--step-s`` seconds
(default: the tiny recipe's ~80 ms on 2 ranks here; pass your own). Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resilient.dist import free_port  # noqa: E402
from resilient.trainer.observing.timing import PHASES, StepPhases, gather_window  # noqa: E402
from resilient.trainer.observing.watchdog import HangWatchdog  # noqa: E402


def _per_step_bookkeeping(calls: int) -> float:
    """Seconds of one step's observer work outside collectives: timers, commit, watchdog beat."""
    phases = StepPhases()
    with tempfile.TemporaryDirectory() as directory:
        watchdog = HangWatchdog(directory, group=0, rank=0, incarnation=0, timeout_s=600)
        watchdog.start()
        start = time.perf_counter()
        for step in range(calls):
            for phase in PHASES[1:]:
                with phases.timed(phase):
                    pass
            phases.commit(0.1)
            watchdog.beat(step)
        elapsed = time.perf_counter() - start
        watchdog.stop()
    return elapsed / calls


def _gather_worker(rank: int, port: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    phases = StepPhases()
    phases.commit(0.1)
    times = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        gather_window(phases)
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(statistics.median(times), f)
    dist.destroy_process_group()


def _gather_seconds(calls: int) -> float:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "gather.json")
        mp.start_processes(_gather_worker, args=(free_port(), calls, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            return float(json.load(f))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-s", type=float, default=0.08, help="step time to relate the cost to (s)")
    parser.add_argument("--rank-every", type=int, default=10, help="metrics.rank_every")
    args = parser.parse_args(argv)
    bookkeeping = _per_step_bookkeeping(20000)
    gather = _gather_seconds(300)
    per_step = bookkeeping + gather / args.rank_every
    lines = [
        {"bench": "observe", "name": "bookkeeping_per_step", "value": round(bookkeeping * 1e6, 2), "unit": "us"},
        {"bench": "observe", "name": "rank_gather_2_ranks", "value": round(gather * 1e6, 1), "unit": "us"},
        {"bench": "observe", "name": "per_step_total", "value": round(per_step * 1e6, 1), "unit": "us"},
        {
            "bench": "ratio",
            "name": f"overhead_share_of_{args.step_s:g}s_step",
            "value": round(per_step / args.step_s, 5),
            "unit": "fraction",
        },
    ]
    for line in lines:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
