"""Ranks for tests/trainer/test_preempt_torchrun.py, run by a real torchrun under the launcher's
``run``: ``python -m tests.trainer.preempt_workers SCENARIO OUT``.

``peer_fails`` (3 ranks): ranks 0 and 1 wait in a collective that never completes (each receives
from the other), rank 2 fails once they are inside it; torchrun then SIGTERMs the two survivors.
``preempted`` (2 ranks): the ranks step until a preemption flag rides on a step's sums, then the
stand-in save (a file named after the stop step) and exit 143, as the trainer does."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from resilient.trainer.preempt import PREEMPTED_EXIT, PreemptWatch


def _touch(out: str, name: str, **fields: object) -> None:
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump({"t": time.time(), **fields}, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def _wait_for(out: str, names: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(out, n)) for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{names} not written within {timeout_s} s")
        time.sleep(0.05)


def peer_fails(rank: int, out: str) -> int:
    if rank == 2:
        _wait_for(out, ["blocked-0", "blocked-1"])
        time.sleep(0.5)  # both inside the C++ receive by now
        _touch(out, "failed")
        os._exit(3)
    buffer = torch.zeros(4)
    _touch(out, f"blocked-{rank}")
    dist.recv(buffer, src=1 - rank)  # nobody sends: only a signal (or the timeout) ends this rank
    _touch(out, f"returned-{rank}")
    return 2


def preempted(rank: int, out: str, watch: PreemptWatch) -> int:
    for step in range(1, 600):
        sums = torch.tensor(watch.start_flags().wait(), dtype=torch.float64)
        dist.all_reduce(sums)
        if watch.agreed_signal(sums.tolist()):
            if rank == 0:
                _touch(out, f"saved-{step}")
            return PREEMPTED_EXIT
        if step == 1:
            _touch(out, f"stepping-{rank}")
        time.sleep(0.05)
    return 2


def main() -> int:
    scenario, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    with PreemptWatch([signal.SIGTERM]) as watch:
        code = peer_fails(rank, out) if scenario == "peer_fails" else preempted(rank, out, watch)
    _touch(out, f"exited-{rank}", code=code)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
