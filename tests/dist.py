"""Run a function on N real processes joined by a gloo process group (CPU, no GPU needed).

Each rank is a child of a fork server that imported torch once (TensorStore, which must not be used
across fork, is imported by the rank itself), with the test's environment and RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT set as torchrun would. Results come back through a queue; a rank that
raises, dies or outlives the timeout fails the call with its traceback, and no process outlives it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from resilient.dist import free_port

# What every rank imports first, done once in the fork server: a rank then starts in a fraction of
# the seconds a fresh interpreter takes to import torch. Nothing here touches TensorStore (which
# must not be used across fork), and the only threads started are OpenBLAS's pool (numpy), which
# has its own fork handlers: ranks import the rest themselves. The server imports these under the
# environment of the first test that starts a world: variables read at import (thread counts,
# TORCH_LOGS) cannot be changed by a later test's ``env=``.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",  # fully_shard imports it on first use
    "numpy",
    "ml_dtypes",  # half a second of its own (resilient.dtypes)
]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(fn: Callable, rank: int, world: int, port: int, env: dict, cwd: str, args: tuple, out: mp.Queue) -> None:
    # A fork server's child has the server's environment and folder, not the test's: as spawn gives.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        import torch.distributed as dist

        if world > 0:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        result = fn(rank, world, *args)
        if world > 0:
            dist.barrier()
            dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def start_world(fn: Callable, world: int, *args: Any, env: dict | None = None) -> tuple[list[mp.Process], mp.Queue]:
    ctx = _context()
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = []
    full_env = {**os.environ, **(env or {})}
    for rank in range(max(world, 1)):
        p = ctx.Process(target=_entry, args=(fn, rank, world, port, full_env, os.getcwd(), args, out), daemon=True)
        p.start()
        procs.append(p)
    return procs, out


def collect(procs: list[mp.Process], out: mp.Queue, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors = []
    try:
        while len(results) + len(errors) < len(procs):
            try:
                rank, status, value = out.get(timeout=timeout_s)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
                raise TimeoutError(f"ranks did not finish within {timeout_s} s (dead without result: {dead})") from None
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return [results[r] for r in sorted(results)]
    finally:
        kill_all(procs)


def kill_all(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL; a rank that ended since is no error (ProcessLookupError suppressed)
        p.join(timeout=10)


def run_world(fn: Callable, world: int, *args: Any, timeout_s: float = 180, env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (world=0: one process, no group)."""
    procs, out = start_world(fn, world, *args, env=env)
    return collect(procs, out, timeout_s)


def outcome(fn: Callable[[], Any]) -> str:
    """What ``fn`` did on this rank: "ok", or the error it raised as "Type: message" (multi-rank
    tests compare it across ranks: every rank must see the same outcome)."""
    try:
        fn()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
