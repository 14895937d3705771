"""Module crossings of one save and one RAM restore: calls from one ``resilient`` module into another
(distinct caller -> callee module pairs, the modules touched, and the calls), traced with
``sys.setprofile`` / ``threading.setprofile``. A structure figure, not a speed one: run it before
and after a refactor (from the repo root: ``.venv/bin/python benchmarks/module_crossings.py``).

The save is one fresh ``Checkpointer`` (save, wait, close: its worker threads start inside the
trace); the restore is the RAM tier's, on a one-rank gloo world, of the newest own snapshot."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def trace(fn: Callable[[], object]) -> dict:
    edges: set[tuple[str, str]] = set()
    calls = [0]

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if callee.startswith("resilient") and caller.startswith("resilient") and callee != caller:
            edges.add((caller, callee))
            calls[0] += 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {"module_pairs": len(edges), "modules": len({m for e in edges for m in e}), "calls": calls[0]}


def main() -> None:
    root = tempfile.mkdtemp()
    store = dist.FileStore(os.path.join(root, "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    from resilient import Checkpointer

    state = {"model": {f"l{i}.w": torch.randn(64, 64) for i in range(8)}, "train": {"step": 1}}
    with Checkpointer(os.path.join(root, "warm")) as ckpt:
        ckpt.save(1, state).wait()  # imports out of the trace

    def one_save() -> None:
        with Checkpointer(os.path.join(root, "ckpt")) as fresh:
            fresh.save(2, state).wait()

    print(json.dumps({"bench": "module_crossings", "path": "save", **trace(one_save)}))
    sys.path.insert(0, os.getcwd())  # the RAM tier's test helpers build a tier the way its tests do
    from tests.recovery.ram import workers

    ram = workers.tier(0, 1, os.path.join(root, "store"))
    for step in (3, 4):
        ram.snapshot(step, workers.state_of(0, step))
        ram.wait(30)
    target = workers.empty_state()
    print(json.dumps({"bench": "module_crossings", "path": "ram_restore", **trace(lambda: ram.restore(target, None))}))
    ram.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
