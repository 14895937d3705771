"""Checkpoint benchmark: resilient vs PyTorch DCP vs this machine's limits, side by side in ONE run.

    python benchmarks/ckpt_bench.py [--total-gib 1.0] [--repeats 2] [--dir /tmp] [--width 2048]

A world of 4 gloo ranks on CPU builds a stack of Linear layers sharded with FSDP2 (``fully_shard``
on a 1-D mesh), runs one AdamW step so the optimizer state exists, and takes the state with
``get_state_dict``. It times our save and DCP's save (fsync on both), then this machine's limits
(fsync'd sequential write of the same bytes, memcpy into reused buffers). Worlds of 2 and 3 ranks
then build the same model and load both 4-rank checkpoints (resharding 4->2, 4->3), each load
checked against a fingerprint of the saved state. Every world runs one untimed warm-up round at
full size, then ``--repeats`` measured rounds.

Every time is the max over ranks of one rank's wall time, after a barrier: a collective operation
is as slow as its slowest rank. stdout carries only JSON lines (one per result, then ratios);
everything else goes to stderr. See benchmarks/README.md for how to read them.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

GIB = 1 << 30
SAVE_WORLD = 4
LOAD_WORLDS = (3, 2)
RAW_WRITE_CHUNK = 64 << 20  # big enough that syscall overhead is noise, small enough to reuse
log = logging.getLogger("ckpt_bench")


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    total_gib: float = 1.0
    """Params + AdamW state (exp_avg, exp_avg_sq), summed over all ranks."""
    width: int = 2048
    """Features of each square Linear layer; the layer count is chosen to hit ``total_gib``."""
    repeats: int = 2
    """Measurements of each kind; lines report the best and the median."""
    root: str = ""
    """Scratch directory for checkpoints and raw writes (created and removed by the run)."""
    timeout_s: float = 1800.0
    """Longest a world may run before it is killed (and the collectives' timeout)."""

    def __post_init__(self) -> None:
        if not 0 < self.total_gib <= 64:
            raise ValueError(f"total_gib must be in (0, 64], got {self.total_gib}")
        if not 8 <= self.width <= 1 << 16:
            raise ValueError(f"width must be in [8, 65536], got {self.width}")
        if not 1 <= self.repeats <= 100:
            raise ValueError(f"repeats must be in [1, 100], got {self.repeats}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def layers(self) -> int:
        # AdamW keeps two fp32 moments per parameter: params + state = 3 x the parameter bytes.
        layer_bytes = (self.width * self.width + self.width) * 4
        return max(1, round(self.total_gib * GIB / 3 / layer_bytes))

    @property
    def resilient_root(self) -> str:
        """One checkpoint root for all our saves (a trainer keeps one); each save is a new step."""
        return os.path.join(self.root, "resilient")

    def resilient_step_dir(self, step: int) -> str:
        from resilient.manifest import step_dir

        return os.path.join(self.resilient_root, step_dir(step))

    def dcp_dir(self, step: int) -> str:
        return os.path.join(self.root, f"dcp-step{step}")


# ---------------------------------------------------------------------------------------------
# model and state (run inside the ranks)


def build_state(cfg: BenchConfig, seed: int) -> tuple[Any, Any, dict]:
    """FSDP2 model on a 1-D mesh of the whole world, one AdamW step taken; returns its state."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Built on meta and materialized after sharding (torchtitan's recipe): no rank ever holds
    # the whole model, and no time goes into initializing weights that are then thrown away.
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(cfg.width, cfg.width) for _ in range(cfg.layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, cfg.width**-0.5, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, cfg.width, generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, fresh_state(model, opt)


def fresh_state(model: Any, opt: Any) -> dict:
    """A new state dict over the same storage. Each load gets its own, because a load may replace
    non-tensor values (param_groups) with its own representation of them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def iter_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from iter_tensors(tree[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_tensors(v, f"{prefix}.{i}")


def local_part(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(state: dict) -> tuple[int, int]:
    """(bytes of the global state, bytes this rank holds). Plain tensors (the optimizer's
    ``step``) are replicated: counted once globally, but every rank holds a copy."""
    total = local = 0
    for _, t in iter_tensors(state):
        local += local_part(t).numel() * t.element_size()
        total += t.numel() * t.element_size()  # a DTensor's numel is its global numel
    return total, local


def fingerprint(state: dict) -> list[list[float]]:
    """Per tensor, [sum over rows of (row sum x global row index), the same over |x|]: catches rows
    that were not loaded or landed at the wrong offset after resharding. The second value scales
    the tolerance, since only the float64 summation order depends on the world size. Collective."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sharded, replicated = [], []
    for _, t in iter_tensors(state):
        data = local_part(t).detach()
        if data.dim() == 0:
            value = float(data.double())
            replicated.append([value, abs(value)])
            continue
        offset = 0
        if isinstance(t, DTensor):
            offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1][0]
        rows = data.reshape(data.shape[0], -1)
        weights = torch.arange(offset + 1, offset + 1 + rows.shape[0], dtype=torch.float64)
        sharded.append(
            [
                float(rows.sum(dim=1, dtype=torch.float64) @ weights),
                float(rows.abs().sum(dim=1, dtype=torch.float64) @ weights),
            ]
        )
    summed = torch.tensor(sharded, dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(summed)  # every tensor with rows here is a DTensor: the pieces add up
    return summed.tolist() + replicated


def check_fingerprint(got: list[list[float]], want: list[list[float]], what: str) -> None:
    bad = [
        i
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if abs(g[0] - w[0]) > 1e-11 * w[1] or abs(g[1] - w[1]) > 1e-11 * w[1]
    ]
    if len(got) != len(want) or bad:
        raise AssertionError(f"{what}: loaded state differs from the saved one (tensors #{bad[:5]})")


def zero_state(state: dict) -> None:
    """Wipe the destination so a load that silently skipped a tensor fails the fingerprint."""
    import torch

    with torch.no_grad():
        for _, t in iter_tensors(state):
            local_part(t).zero_()


# ---------------------------------------------------------------------------------------------
# timed operations (run inside the ranks)


def max_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` took on the slowest rank; the barrier makes all ranks start together."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return max_over_ranks([time.perf_counter() - start])[0]


def timed_save_resilient(ckpt: Any, state: dict, step: int) -> tuple[float, float, list[float]]:
    """(seconds until save() returned, i.e. training was blocked; seconds until the step was
    committed; the save's own [snapshot, persist, commit] seconds), each the max over ranks."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    handle = ckpt.save(step, state)
    blocked = time.perf_counter() - start
    stats = handle.wait()
    total = time.perf_counter() - start
    phases = [stats.snapshot_s, stats.persist_s, stats.commit_s] if stats is not None else [0.0] * 3
    blocked, total, *phases = max_over_ranks([blocked, total, *phases])
    return blocked, total, phases


def save_dcp(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def timed_async_dcp(state: dict, path: str, mode: str) -> tuple[float, float]:
    """DCP async_save in its thread or process mode: (seconds blocked, seconds to durable)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    dist.barrier()
    start = time.perf_counter()
    future = dcp.async_save(
        state, storage_writer=dcp.FileSystemWriter(path, sync_files=True), async_checkpointer_type=kind
    )
    blocked = time.perf_counter() - start
    future.result()
    total = time.perf_counter() - start
    blocked, total = max_over_ranks([blocked, total])
    return blocked, total


def load_dcp(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(path))


def raw_fsync_write(path: str, nbytes: int, buffer: memoryview) -> None:
    """The disk's limit: this rank's share written sequentially from one reused buffer, then
    fsync'd, as a checkpoint must be before it may be called durable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buffer[: min(left, len(buffer))])
        os.fsync(fd)
    finally:
        os.close(fd)


def memcpy_into(sources: list[Any], targets: list[Any]) -> None:
    for src, dst in zip(sources, targets, strict=True):
        dst.copy_(src)


def peak_rss_gib() -> float:
    """This world's largest peak resident set over ranks (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        kib = 0
    return max_over_ranks([kib / (1 << 20)])[0]


# ---------------------------------------------------------------------------------------------
# the worlds (each function runs on every rank of one spawned world)
#
# Round 0 of every world is a warm-up at full size, untimed, for both implementations alike:
# imports (tensorstore alone takes ~0.7 s), thread pools, and our staging pool (allocated and
# touched by the first save of a Checkpointer, reused after) are paid once by a trainer, not per
# checkpoint. Rounds 1..repeats are measured. One Checkpointer per world, as in a trainer.


def _remove(paths: list[str]) -> None:
    """Rank 0 deletes, then everyone waits: no rank may start the next timing during a delete."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def _order(round_: int) -> list[str]:
    # Alternate who goes first, so neither always meets the other's dirty pages in the cache.
    return ["resilient", "dcp"] if round_ % 2 == 0 else ["dcp", "resilient"]


def save_world(rank: int, world: int, cfg: BenchConfig) -> dict:
    from resilient import Checkpointer

    _model, _opt, state = build_state(cfg, seed=1)
    total, local = state_bytes(state)
    saved = fingerprint(state)
    times: dict[str, list[float]] = {"resilient": [], "resilient_blocked": [], "dcp": []}
    with Checkpointer(cfg.resilient_root) as ckpt:
        for step in range(cfg.repeats + 1):
            for impl in _order(step):
                if impl == "resilient":
                    blocked, seconds, phases = timed_save_resilient(ckpt, state, step)
                    log.info(
                        "save resilient step %d: %.3f s (blocked %.3f s; snapshot/persist/commit %s s)",
                        step,
                        seconds,
                        blocked,
                        [round(x, 3) for x in phases],
                    )
                else:
                    seconds = timed(lambda step=step: save_dcp(state, cfg.dcp_dir(step)))
                    log.info("save dcp step %d: %.3f s", step, seconds)
                if step > 0:
                    times[impl].append(seconds)
                    if impl == "resilient":
                        times["resilient_blocked"].append(blocked)
            for mode in ("thread", "process"):  # DCP's asynchronous saves, both of its modes
                path = cfg.dcp_dir(step) + f"-async-{mode}"
                blocked, seconds = timed_async_dcp(state, path, mode)
                log.info("async_save dcp %s step %d: blocked %.3f s, durable %.3f s", mode, step, blocked, seconds)
                if step > 0:
                    times.setdefault(f"dcp_async_{mode}", []).append(seconds)
                    times.setdefault(f"dcp_async_{mode}_blocked", []).append(blocked)
                _remove([path])
            if step > 0:  # keep only the newest pair: it is what the load worlds read
                _remove([cfg.resilient_step_dir(step - 1), cfg.dcp_dir(step - 1)])
    sources = [local_part(t).detach() for _, t in iter_tensors(state)]
    times.update(_limits(cfg, rank, local, sources))
    log.info("save world: peak RSS per rank %.2f GiB", peak_rss_gib())
    return {"bytes": total, "local_bytes": local, "fingerprint": saved, "seconds": times}


def _limits(cfg: BenchConfig, rank: int, local: int, sources: list[Any]) -> dict[str, list[float]]:
    import torch

    buffer = memoryview(bytearray(os.urandom(1 << 20)) * (RAW_WRITE_CHUNK >> 20))
    path = os.path.join(cfg.root, f"raw-rank{rank}.bin")
    raw = []
    for i in range(cfg.repeats):
        raw.append(timed(lambda: raw_fsync_write(path, local, buffer)))
        os.unlink(path)
        log.info("raw fsync write repeat %d: %.3f s", i, raw[-1])
    # Reused, already-touched targets: copying into fresh memory pays page faults and ran ~5x
    # slower here (ENV-NOTES), which is a property of the allocator, not of the bandwidth.
    targets = [torch.empty_like(s) for s in sources]
    memcpy_into(sources, targets)
    copies = [timed(lambda: memcpy_into(sources, targets)) for _ in range(cfg.repeats)]
    log.info("memcpy: %s s", [round(c, 3) for c in copies])
    return {"raw_fsync_write": raw, "memcpy": copies}


def load_world(rank: int, world: int, cfg: BenchConfig, saved: list[list[float]]) -> dict:
    from resilient import Checkpointer

    model, opt, _ = build_state(cfg, seed=2)
    with Checkpointer(cfg.resilient_root) as ckpt:
        times = _load_rounds(cfg, world, ckpt, model, opt, saved)
    log.info("load world of %d: peak RSS per rank %.2f GiB", world, peak_rss_gib())
    return {"seconds": times}


def _load_rounds(
    cfg: BenchConfig, world: int, ckpt: Any, model: Any, opt: Any, saved: list[list[float]]
) -> dict[str, list[float]]:
    step = cfg.repeats  # the newest pair survives the save world's cleanup
    times: dict[str, list[float]] = {"resilient": [], "dcp": []}
    for round_ in range(cfg.repeats + 1):
        for impl in _order(round_):
            state = fresh_state(model, opt)
            zero_state(state)
            if impl == "resilient":
                seconds = timed(lambda s=state: ckpt.load(s, step=step))
            else:
                seconds = timed(lambda s=state: load_dcp(s, cfg.dcp_dir(step)))
            check_fingerprint(fingerprint(state), saved, f"{impl} load 4->{world}")
            log.info("load %s 4->%d round %d: %.3f s (verified)", impl, world, round_, seconds)
            if round_ > 0:
                times[impl].append(seconds)
    return times


# ---------------------------------------------------------------------------------------------
# spawning worlds (TensorStore aborts in forked children that use it: spawn only)


def _rank_entry(fn: Callable, rank: int, world: int, port: int, cfg: BenchConfig, args: tuple, out: Any) -> None:
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
    _setup_logging(rank, quiet=rank != 0)
    try:
        import torch
        import torch.distributed as dist

        # More ranks than cores already: intra-op threads on top would only thrash.
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg.timeout_s))
        result = fn(rank, world, cfg, *args)
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_world(fn: Callable, world: int, cfg: BenchConfig, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, cfg, *args)`` on ``world`` spawned gloo ranks; per-rank results.
    A rank that fails, dies or outlives ``cfg.timeout_s`` fails the run, and no rank outlives it."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    from resilient.dist import free_port

    port = free_port()
    # Not daemonic: DCP's async_save in process mode starts a child of its own. The finally
    # clause below kills every rank, so none outlives the run.
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, r, world, port, cfg, args, out), daemon=False) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while len(results) < world:
            try:
                rank, status, value = out.get(timeout=5)
            except queue.Empty:
                # A rank killed outright (e.g. out of memory) reports nothing: notice it early.
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"ranks {dead} died" if dead else f"not done within {cfg.timeout_s:.0f} s"
                    raise RuntimeError(f"{fn.__name__} on {world} ranks: {why}") from None
                continue
            if status != "ok":
                raise RuntimeError(f"{fn.__name__} failed on rank {rank} of {world}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)


# ---------------------------------------------------------------------------------------------
# results (parent process)


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def result_line(bench: str, impl: str, to_world: int, nbytes: int, seconds: list[float]) -> dict:
    """The median is the headline (robust to one disturbed run on a shared machine); the best is
    what the code can do when nothing else gets in the way."""
    median, best = statistics.median(seconds), min(seconds)
    return {
        "bench": bench,
        "impl": impl,
        "from_world": SAVE_WORLD,
        "to_world": to_world,
        "bytes": nbytes,
        "seconds": round(median, 4),
        "gib_per_s": round(nbytes / median / GIB, 4),
        "best_seconds": round(best, 4),
        "best_gib_per_s": round(nbytes / best / GIB, 4),
        "repeats": len(seconds),
        "all_seconds": [round(s, 4) for s in seconds],
    }


def ratio_line(name: str, ours: dict, other: dict) -> dict:
    """Throughput of ``ours`` over ``other``: > 1 means ``ours`` moves bytes faster."""
    return {
        "bench": "ratio",
        "name": name,
        "value": round(ours["gib_per_s"] / other["gib_per_s"], 4),
        "best_value": round(ours["best_gib_per_s"] / other["best_gib_per_s"], 4),
    }


def blocking_ratio_line(ours: dict, dcp: dict) -> dict:
    """Bytes per second of blocked training, ours over DCP's: DCP's synchronous save blocks for
    all of it, ours only until save() returns. > 1 means ours blocks training for less time."""
    return {
        "bench": "ratio",
        "name": "save_blocking_resilient_over_dcp",
        "value": round(dcp["seconds"] / ours["blocked_seconds"], 4),
        "best_value": round(dcp["best_seconds"] / ours["best_blocked_seconds"], 4),
    }


def run(cfg: BenchConfig) -> None:
    log.info(
        "model: %d Linear(%d, %d) layers, target %.3f GiB of params + AdamW state",
        cfg.layers,
        cfg.width,
        cfg.width,
        cfg.total_gib,
    )
    saved = run_world(save_world, SAVE_WORLD, cfg)
    nbytes, seconds = saved[0]["bytes"], saved[0]["seconds"]
    all_local = sum(r["local_bytes"] for r in saved)  # what the limits actually moved
    lines = {
        "save_resilient": {
            **result_line("save", "resilient", SAVE_WORLD, nbytes, seconds["resilient"]),
            # save() returns once the state is staged; the persist and commit run in the background
            "blocked_seconds": round(statistics.median(seconds["resilient_blocked"]), 4),
            "best_blocked_seconds": round(min(seconds["resilient_blocked"]), 4),
        },
        "save_dcp": result_line("save", "dcp", SAVE_WORLD, nbytes, seconds["dcp"]),
        **{
            f"save_dcp_async_{mode}": {
                **result_line("save", f"dcp_async_{mode}", SAVE_WORLD, nbytes, seconds[f"dcp_async_{mode}"]),
                "blocked_seconds": round(statistics.median(seconds[f"dcp_async_{mode}_blocked"]), 4),
                "best_blocked_seconds": round(min(seconds[f"dcp_async_{mode}_blocked"]), 4),
            }
            for mode in ("thread", "process")
        },
        "raw_fsync": result_line("limit", "raw_fsync_write", SAVE_WORLD, all_local, seconds["raw_fsync_write"]),
        "memcpy": result_line("limit", "memcpy", SAVE_WORLD, all_local, seconds["memcpy"]),
    }
    for line in lines.values():
        emit(line)
    for world in LOAD_WORLDS:
        loaded = run_world(load_world, world, cfg, saved[0]["fingerprint"])[0]["seconds"]
        for impl in ("resilient", "dcp"):
            lines[f"load_4to{world}_{impl}"] = result_line("load", impl, world, nbytes, loaded[impl])
            emit(lines[f"load_4to{world}_{impl}"])
    emit_ratios(lines)


def stall_ratio_lines(lines: dict[str, dict]) -> list[dict]:
    """How long save() blocks training: ours over the memcpy floor, and over DCP async_save's
    better mode (< 1 means ours blocks for less time)."""
    ours = lines["save_resilient"]
    best_dcp = min((lines[f"save_dcp_async_{m}"] for m in ("thread", "process")), key=lambda d: d["blocked_seconds"])
    return [
        {
            "bench": "ratio",
            "name": "stall_resilient_over_memcpy_floor",
            "value": round(ours["blocked_seconds"] / lines["memcpy"]["seconds"], 4),
            "best_value": round(ours["best_blocked_seconds"] / lines["memcpy"]["best_seconds"], 4),
        },
        {
            "bench": "ratio",
            "name": f"stall_resilient_over_dcp_async_{best_dcp['impl'].rsplit('_', 1)[1]}",
            "value": round(ours["blocked_seconds"] / best_dcp["blocked_seconds"], 4),
            "best_value": round(ours["best_blocked_seconds"] / best_dcp["best_blocked_seconds"], 4),
        },
        {
            "bench": "ratio",
            "name": "durable_resilient_over_dcp_async_thread",  # throughput, > 1: ours faster
            "value": round(ours["gib_per_s"] / lines["save_dcp_async_thread"]["gib_per_s"], 4),
            "best_value": round(ours["best_gib_per_s"] / lines["save_dcp_async_thread"]["best_gib_per_s"], 4),
        },
    ]


def emit_ratios(lines: dict[str, dict]) -> None:
    for line in stall_ratio_lines(lines):
        emit(line)
    emit(ratio_line("save_resilient_over_dcp", lines["save_resilient"], lines["save_dcp"]))
    emit(blocking_ratio_line(lines["save_resilient"], lines["save_dcp"]))
    for world in LOAD_WORLDS:
        emit(
            ratio_line(
                f"load_4to{world}_resilient_over_dcp",
                lines[f"load_4to{world}_resilient"],
                lines[f"load_4to{world}_dcp"],
            )
        )
    emit(ratio_line("save_resilient_over_raw_fsync", lines["save_resilient"], lines["raw_fsync"]))
    emit(ratio_line("save_dcp_over_raw_fsync", lines["save_dcp"], lines["raw_fsync"]))
    for world in LOAD_WORLDS:
        emit(ratio_line(f"load_4to{world}_resilient_over_memcpy", lines[f"load_4to{world}_resilient"], lines["memcpy"]))


def _setup_logging(rank: int | None, *, quiet: bool = False) -> None:
    where = "main" if rank is None else f"rank {rank}"
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format=f"%(asctime)s [{where}] %(name)s: %(message)s", force=True
    )
    log.setLevel(logging.WARNING if quiet else logging.INFO)


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-gib", type=float, default=1.0, help="params + AdamW state over all ranks")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each kind")
    parser.add_argument("--width", type=int, default=2048, help="features of each Linear layer")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="parent of the scratch directory")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit for each world")
    args = parser.parse_args(argv)
    cfg = BenchConfig(total_gib=args.total_gib, width=args.width, repeats=args.repeats, timeout_s=args.timeout_s)
    return cfg, args.dir


def main(argv: list[str] | None = None) -> None:
    cfg, parent = parse_args(argv)
    _setup_logging(None)
    os.makedirs(parent, exist_ok=True)
    cfg.root = tempfile.mkdtemp(prefix="ckpt_bench-", dir=parent)
    started = time.perf_counter()
    try:
        run(cfg)
    finally:
        shutil.rmtree(cfg.root, ignore_errors=True)
    log.info("done in %.1f s", time.perf_counter() - started)


if __name__ == "__main__":
    main()
