"""What every benchmark case of ``ckpt_bench.py`` shares: spawning worlds of ranks, timing, and the
JSON lines (results and ratios) it prints.

stdout belongs to the JSON lines; logs go to stderr. Every blocking wait here has a limit.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

GIB = 1 << 30
log = logging.getLogger("ckpt_bench")


# ---------------------------------------------------------------------------------------------
# timing (inside a world; with no process group, "the ranks" is this one process)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def max_over_ranks(values: list[float]) -> list[float]:
    if not _distributed():
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    if _distributed():
        import torch.distributed as dist

        dist.barrier()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` took on the slowest rank; the barrier makes all ranks start together."""
    barrier()
    start = time.perf_counter()
    fn()
    return max_over_ranks([time.perf_counter() - start])[0]


def timed_save_resilient(ckpt: Any, state: dict, step: int, *, timeout_s: float) -> tuple[float, float, list[float]]:
    """(seconds until save() returned, i.e. training was blocked; seconds until the step was
    committed; the save's own [snapshot, persist, commit] seconds), each the max over ranks."""
    barrier()
    start = time.perf_counter()
    handle = ckpt.save(step, state)
    blocked = time.perf_counter() - start
    stats = handle.wait(timeout=timeout_s)
    total = time.perf_counter() - start
    phases = [stats.snapshot_s, stats.persist_s, stats.commit_s] if stats is not None else [0.0] * 3
    blocked, total, *phases = max_over_ranks([blocked, total, *phases])
    return blocked, total, phases


def peak_rss_gib() -> float:
    """This world's largest peak resident set over ranks (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        kib = 0
    return max_over_ranks([kib / (1 << 20)])[0]


def alternate(round_: int, first: str, second: str) -> list[str]:
    """Who goes first in a round: alternating, so neither side always meets the other's leftovers
    (dirty pages in the cache, an endpoint's garbage) first."""
    return [first, second] if round_ % 2 == 0 else [second, first]


# ---------------------------------------------------------------------------------------------
# spawning worlds (TensorStore aborts in forked children that use it: spawn only)


def _rank_entry(
    fn: Callable, rank: int, world: int, port: int, cfg: Any, args: tuple, out: Any, process_group: bool
) -> None:
    # stdout belongs to the JSON lines the parent prints; anything a library prints goes to stderr.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # As torchrun would set them (the Checkpointer splits its staging budget by LOCAL_WORLD_SIZE).
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    setup_logging(rank, quiet=rank != 0)
    try:
        import torch
        import torch.distributed as dist

        if world > 1:  # more ranks than cores already: intra-op threads on top would only thrash
            torch.set_num_threads(1)
        if process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg.timeout_s))
        result = fn(rank, world, cfg, *args)
        if process_group:
            dist.barrier()
            dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_world(fn: Callable, world: int, cfg: Any, *args: Any, process_group: bool = True) -> list[Any]:
    """Run ``fn(rank, world, cfg, *args)`` on ``world`` spawned ranks (a gloo process group among
    them unless ``process_group`` is false, which needs a world of 1); per-rank results. A rank that
    fails, dies or outlives ``cfg.timeout_s`` fails the run, and no rank outlives it."""
    if not process_group and world != 1:
        raise ValueError(f"a world without a process group has 1 rank, not {world}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    from resilient.dist import free_port

    port = free_port()
    # Not daemonic: DCP's async_save in process mode starts a child of its own. The finally
    # clause below kills every rank, so none outlives the run.
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, r, world, port, cfg, args, out, process_group), daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(fn, world, cfg.timeout_s, procs, out)
    finally:
        for p in procs:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)


def _collect(fn: Callable, world: int, timeout_s: float, procs: list[Any], out: Any) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world:
        try:
            rank, status, value = out.get(timeout=5)
        except queue.Empty:
            # A rank killed outright (e.g. out of memory) reports nothing: notice it early.
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                why = f"ranks {dead} died" if dead else f"not done within {timeout_s:.0f} s"
                raise RuntimeError(f"{fn.__name__} on {world} ranks: {why}") from None
            continue
        if status != "ok":
            raise RuntimeError(f"{fn.__name__} failed on rank {rank} of {world}:\n{value}")
        results[rank] = value
    return [results[r] for r in range(world)]


# ---------------------------------------------------------------------------------------------
# results (parent process)


def files_of(step_dir: str) -> list[tuple[str, int]]:
    """The (file, size) pairs of one saved step, relative to it, in a stable order."""
    files = []
    for here, subdirs, names in os.walk(step_dir):
        subdirs.sort()
        rel = os.path.relpath(here, step_dir)
        files += [
            (os.path.normpath(os.path.join(rel, n)), os.path.getsize(os.path.join(here, n))) for n in sorted(names)
        ]
    return files


def write_files_floor(root: str, files: list[tuple[str, int]], buffer: memoryview) -> None:
    """The floor of our file pattern on this file system: ``files`` (the same names, so the same
    directories, and sizes as a step we saved) created, written from one reused ``buffer`` and made
    durable by our writer's own file layer (``localwrite.AttemptFiles``: parents made as needed,
    O_EXCL create, writeback started as the bytes land, one syncfs or per-file fdatasync as it
    chooses), one file after another. No planning, encoding, checksums, receipts nor commit."""
    from resilient.storage.localwrite import AttemptFiles

    attempt = AttemptFiles(root, expected_files=len(files))
    try:
        for name, size in files:
            whole, rest = divmod(size, len(buffer))
            attempt.make_parent(name)
            attempt.write(name, [buffer] * whole + [buffer[:rest]])
        attempt.make_durable(threads=1)
    finally:
        attempt.close()


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def result_line(bench: str, impl: str, nbytes: int, seconds: list[float], *, from_world: int, to_world: int) -> dict:
    """The median is the headline (robust to one disturbed run on a shared machine); the best is
    what the code can do when nothing else gets in the way."""
    median, best = statistics.median(seconds), min(seconds)
    return {
        "bench": bench,
        "impl": impl,
        "from_world": from_world,
        "to_world": to_world,
        "bytes": nbytes,
        "seconds": round(median, 4),
        "gib_per_s": round(nbytes / median / GIB, 4),
        "best_seconds": round(best, 4),
        "best_gib_per_s": round(nbytes / best / GIB, 4),
        "repeats": len(seconds),
        "all_seconds": [round(s, 4) for s in seconds],
    }


def blocked_fields(blocked: list[float]) -> dict:
    """How long save() held the caller (median, best): the rest of a save runs in the background."""
    return {
        "blocked_seconds": round(statistics.median(blocked), 4),
        "best_blocked_seconds": round(min(blocked), 4),
    }


def ratio_line(name: str, ours: dict, other: dict) -> dict:
    """Throughput of ``ours`` over ``other``: > 1 means ``ours`` moves bytes faster."""
    return {
        "bench": "ratio",
        "name": name,
        "value": round(ours["gib_per_s"] / other["gib_per_s"], 4),
        "best_value": round(ours["best_gib_per_s"] / other["best_gib_per_s"], 4),
    }


def setup_logging(rank: int | None, *, quiet: bool = False) -> None:
    where = "main" if rank is None else f"rank {rank}"
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format=f"%(asctime)s [{where}] %(name)s: %(message)s", force=True
    )
    log.setLevel(logging.WARNING if quiet else logging.INFO)
