"""What the per-step preemption check costs, before and after it rode on the step's sums.

    nice -n 5 .venv/bin/python benchmarks/preempt_check_bench.py [--iters 2000] [--rounds 5]

On 2 gloo ranks (the tiny recipe's dp_shard=2 world), alternating rounds, medians:

- ``blocking_check``: what every step paid before: one blocking MAX all-reduce of one int64, on its
  own, before the step;
- ``sums_6`` / ``sums_7``: the step's own SUM all-reduce of its float64 sums without and with one
  preemption flag riding on it (what every step pays now: the difference of the two);
- ``async_tp_check``: the tensor-parallel case, the flags' MAX all-reduce started async and waited
  after a stand-in for the step's compute (a 2 ms sleep): the wait left over.

One JSON line per measure (microseconds), and a line of ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from resilient.dist import free_port  # noqa: E402


def _time(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / iters * 1e6


def _async_check(compute_s: float) -> float:
    flags = torch.zeros(1, dtype=torch.float64)
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
    time.sleep(compute_s)  # the step's compute
    start = time.perf_counter()
    work.wait()
    return time.perf_counter() - start


def _rank(rank: int, port: int, iters: int, rounds: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    flag = torch.zeros(1, dtype=torch.int64)
    sums6, sums7 = torch.zeros(6, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)
    cases = {
        "blocking_check": lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX),
        "sums_6": lambda: dist.all_reduce(sums6),
        "sums_7": lambda: dist.all_reduce(sums7),
    }
    results: dict[str, list[float]] = {name: [] for name in [*cases, "async_tp_check"]}
    for _ in range(rounds):  # alternating: the machine's drift hits every case alike
        for name, fn in cases.items():
            results[name].append(_time(fn, iters))
        waits = [_async_check(0.002) for _ in range(max(iters // 20, 10))]
        results["async_tp_check"].append(statistics.median(waits) * 1e6)
    if rank == 0:
        out.put({name: statistics.median(values) for name, values in results.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.iters, args.rounds, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    medians = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    for name, us in medians.items():
        print(json.dumps({"measure": name, "median_us": round(us, 1), "ranks": 2, "backend": "gloo"}))
    rider = medians["sums_7"] - medians["sums_6"]
    print(
        json.dumps(
            {
                "before_us_per_step": round(medians["blocking_check"], 1),
                "after_us_per_step": round(rider, 1),
                "after_over_before": round(rider / medians["blocking_check"], 3),
                "async_tp_wait_us": round(medians["async_tp_check"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
