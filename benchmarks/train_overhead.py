"""Step-time overhead of checkpointing inside a small training loop, and what the save stalls.

One process trains an MLP (Python + torch work every step, like a real loop) and saves its model
+ AdamW state every ``--every`` steps; the same loop runs with no checkpoints, with the
background writer as a thread, and as a process. Prints one JSON line per variant:
the mean step time, the overhead against the no-checkpoint loop, and the mean time save() blocked.

    python benchmarks/train_overhead.py [--state-mib 256] [--steps 60] [--every 10] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn as nn


def build(state_mib: float, batch: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    # params + exp_avg + exp_avg_sq = 3 copies of the parameters in fp32
    width = int((state_mib * 2**20 / 3 / 4 / 4) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, torch.randn(batch, width)


def loop(state_mib: float, batch: int, steps: int, every: int, writer: str | None, root: str) -> dict:
    from resilient import Checkpointer, CheckpointerConfig

    model, opt, x = build(state_mib, batch)
    ckpt = Checkpointer(root, config=CheckpointerConfig(writer=writer, keep_last=2)) if writer else None
    times, stalls = [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ckpt is not None and step % every == 0:
            s0 = time.perf_counter()
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()["state"]})
            stalls.append(time.perf_counter() - s0)
        times.append(time.perf_counter() - t0)
    if ckpt is not None:
        ckpt.close()
    warm = times[every:]  # the first interval pays one-time costs (allocation, writer start-up)
    return {"mean_step_s": statistics.mean(warm), "stall_s": statistics.mean(stalls[1:] or stalls or [0.0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=float, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--batch",
        type=int,
        default=64,
        help="rows per step: compute per state byte (a pretraining rank processes 10^4-10^6 tokens "
        "per step; 64 makes checkpointing look as expensive as it can)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # leave the other core to the writer, as a GPU job leaves its CPUs
    results = {}
    for writer in (None, "thread", "process"):
        with tempfile.TemporaryDirectory(prefix="resilient-overhead-") as root:
            results[writer] = loop(args.state_mib, args.batch, args.steps, args.every, writer, root)
    base = results[None]["mean_step_s"]
    for writer, r in results.items():
        print(
            json.dumps(
                {
                    "bench": "train_overhead",
                    "writer": writer or "none",
                    "state_mib": args.state_mib,
                    "save_every": args.every,
                    "batch": args.batch,
                    "mean_step_s": round(r["mean_step_s"], 5),
                    "overhead": round(r["mean_step_s"] / base - 1, 4),
                    "save_stall_s": round(r["stall_s"], 5),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
