"""Checkpoint benchmark: resilient vs PyTorch DCP vs this machine's limits, side by side in ONE run.

    python benchmarks/ckpt_bench.py [--total-gib 1.0] [--repeats 2] [--dir /tmp] [--width 2048]
        [--small-tensors 2000] [--small-kib 16] [--s3] [--s3-mib 256]

A world of 4 gloo ranks on CPU builds a stack of Linear layers sharded with FSDP2 (``fully_shard``
on a 1-D mesh), runs one AdamW step so the optimizer state exists, and takes the state with
``get_state_dict``. It times our save and DCP's save (fsync on both), then this machine's limits
(fsync'd sequential write of the same bytes, memcpy into reused buffers). Worlds of 2 and 3 ranks
then build the same model and load both 4-rank checkpoints (resharding 4->2, 4->3), each load
checked against a fingerprint of the saved state. Every world runs one untimed warm-up round at
full size, then ``--repeats`` measured rounds.

Then two cases in one process each: many small tensors, ours against DCP (``bench_small.py``;
``--small-tensors 0`` skips it), and, with ``--s3``, our save and load through a loopback S3
endpoint against that endpoint's raw PUT/GET rate (``bench_s3.py``).

Every time is the max over ranks of one rank's wall time, after a barrier: a collective operation
is as slow as its slowest rank. stdout carries only JSON lines (one per result, then ratios);
everything else goes to stderr. See benchmarks/README.md for how to read them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from bench_common import (
    GIB,
    alternate,
    blocked_fields,
    emit,
    files_of,
    max_over_ranks,
    peak_rss_gib,
    ratio_line,
    result_line,
    run_world,
    setup_logging,
    timed,
    timed_save_resilient,
    write_files_floor,
)
from bench_fsdp_state import (
    build_state,
    check_fingerprint,
    fingerprint,
    fresh_state,
    iter_tensors,
    local_part,
    state_bytes,
    zero_state,
)
from bench_packed import PackedConfig, S3SmallConfig, run_objects, run_s3_small
from bench_s3 import S3Config, moto_available, moto_path, run_s3
from bench_small import SmallConfig, run_small

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
# timed operations (run inside the ranks)


def save_dcp(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def timed_async_dcp(state: dict, path: str, mode: str, timeout_s: float) -> tuple[float, float]:
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
    future.result(timeout=timeout_s)
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
    return alternate(round_, "resilient", "dcp")


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
                    blocked, seconds, phases = timed_save_resilient(ckpt, state, step, timeout_s=cfg.timeout_s)
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
                blocked, seconds = timed_async_dcp(state, path, mode, cfg.timeout_s)
                log.info("async_save dcp %s step %d: blocked %.3f s, durable %.3f s", mode, step, blocked, seconds)
                if step > 0:
                    times.setdefault(f"dcp_async_{mode}", []).append(seconds)
                    times.setdefault(f"dcp_async_{mode}_blocked", []).append(blocked)
                _remove([path])
            if step > 0:  # keep only the newest pair: it is what the load worlds read
                _remove([cfg.resilient_step_dir(step - 1), cfg.dcp_dir(step - 1)])
    sources = [local_part(t).detach() for _, t in iter_tensors(state)]
    times.update(_limits(cfg, rank, world, local, sources))
    log.info("save world: peak RSS per rank %.2f GiB", peak_rss_gib())
    return {"bytes": total, "local_bytes": local, "fingerprint": saved, "seconds": times}


def _limits(cfg: BenchConfig, rank: int, world: int, local: int, sources: list[Any]) -> dict[str, list[float]]:
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
    # round robin by name: shares of about the same size for equal layers
    mine = files_of(cfg.resilient_step_dir(cfg.repeats))[rank::world]
    tree = []
    for i in range(cfg.repeats):
        root = os.path.join(cfg.root, f"raw-tree-{i}")
        tree.append(timed(lambda r=root: write_files_floor(r, mine, buffer)))
        _remove([root])
        log.info("raw tree write repeat %d: %.3f s (%d files on this rank)", i, tree[-1], len(mine))
    return {"raw_fsync_write": raw, "memcpy": copies, "raw_tree_write": tree}


def load_world(rank: int, world: int, cfg: BenchConfig, saved: list[list[float]]) -> dict:
    from resilient import Checkpointer

    model, opt, _ = build_state(cfg, seed=2)
    with Checkpointer(cfg.resilient_root) as ckpt:
        times = _load_rounds(cfg, world, ckpt, model, opt, saved)
        # Read amplification of our loads: bytes fetched (whole inner chunks, crcs, shard indexes)
        # over bytes needed, summed over ranks.
        import torch
        import torch.distributed as dist

        last = ckpt.restore_stats[-1]
        totals = torch.tensor([last.bytes_fetched, last.bytes_read], dtype=torch.float64)
        dist.all_reduce(totals)
    log.info("load world of %d: peak RSS per rank %.2f GiB", world, peak_rss_gib())
    return {"seconds": times, "read_amplification": round(float(totals[0] / totals[1]), 4)}


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


def _line(bench: str, impl: str, nbytes: int, seconds: list[float], to_world: int = SAVE_WORLD) -> dict:
    return result_line(bench, impl, nbytes, seconds, from_world=SAVE_WORLD, to_world=to_world)


def blocking_ratio_line(ours: dict, dcp: dict) -> dict:
    """Bytes per second of blocked training, ours over DCP's: DCP's synchronous save blocks for
    all of it, ours only until save() returns. > 1 means ours blocks training for less time."""
    return {
        "bench": "ratio",
        "name": "save_blocking_resilient_over_dcp",
        "value": round(dcp["seconds"] / ours["blocked_seconds"], 4),
        "best_value": round(dcp["best_seconds"] / ours["best_blocked_seconds"], 4),
    }


def run_fsdp(cfg: BenchConfig) -> None:
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
            **_line("save", "resilient", nbytes, seconds["resilient"]),
            # save() returns once the state is staged; the persist and commit run in the background
            **blocked_fields(seconds["resilient_blocked"]),
        },
        "save_dcp": _line("save", "dcp", nbytes, seconds["dcp"]),
        **{
            f"save_dcp_async_{mode}": {
                **_line("save", f"dcp_async_{mode}", nbytes, seconds[f"dcp_async_{mode}"]),
                **blocked_fields(seconds[f"dcp_async_{mode}_blocked"]),
            }
            for mode in ("thread", "process")
        },
        "raw_fsync": _line("limit", "raw_fsync_write", all_local, seconds["raw_fsync_write"]),
        "memcpy": _line("limit", "memcpy", all_local, seconds["memcpy"]),
        "raw_tree": _line("limit", "raw_tree_write", nbytes, seconds["raw_tree_write"]),
    }
    for line in lines.values():
        emit(line)
    for world in LOAD_WORLDS:
        result = run_world(load_world, world, cfg, saved[0]["fingerprint"])[0]
        loaded = result["seconds"]
        for impl in ("resilient", "dcp"):
            lines[f"load_4to{world}_{impl}"] = _line("load", impl, nbytes, loaded[impl], to_world=world)
            if impl == "resilient":
                lines[f"load_4to{world}_{impl}"]["read_amplification"] = result["read_amplification"]
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
    # Our code against the floor of our own file pattern, and that floor against one file per rank:
    # what is left to our code, and what the layout costs on this file system.
    emit(ratio_line("save_resilient_over_raw_tree", lines["save_resilient"], lines["raw_tree"]))
    emit(ratio_line("raw_tree_over_raw_fsync", lines["raw_tree"], lines["raw_fsync"]))
    for world in LOAD_WORLDS:
        emit(ratio_line(f"load_4to{world}_resilient_over_memcpy", lines[f"load_4to{world}_resilient"], lines["memcpy"]))


@dataclass(kw_only=True, slots=True)
class Cases:
    """What one run measures: the FSDP case always; the others when asked for (None: skipped)."""

    fsdp: BenchConfig
    small: SmallConfig | None
    s3: S3Config | None
    s3_small: S3SmallConfig | None
    objects: PackedConfig | None
    fsdp_too: bool
    parent: str
    """Parent of the run's scratch directory."""


def parse_args(argv: list[str] | None = None) -> Cases:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-gib", type=float, default=1.0, help="params + AdamW state over all ranks")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each kind")
    parser.add_argument("--width", type=int, default=2048, help="features of each Linear layer")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="parent of the scratch directory")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit for each world")
    parser.add_argument("--small-tensors", type=int, default=2000, help="tensors of the small-tensor case (0: skip)")
    parser.add_argument("--small-kib", type=int, default=16, help="KiB of each small tensor")
    parser.add_argument("--s3", action="store_true", help="run the S3 case (needs moto_server in the venv)")
    parser.add_argument("--s3-mib", type=int, default=256, help="MiB saved in the S3 case")
    parser.add_argument(
        "--objects", action="store_true", help="objects per step and the sharded small-tensor case, ours vs DCP"
    )
    parser.add_argument("--objects-tensors", default="200,2000", help="small-tensor counts of --objects")
    parser.add_argument("--objects-world", type=int, default=4, help="ranks of --objects")
    parser.add_argument("--only", action="store_true", help="skip the FSDP case (run only the cases asked for)")
    args = parser.parse_args(argv)
    common = {"repeats": args.repeats, "timeout_s": args.timeout_s}
    try:
        return Cases(
            fsdp=BenchConfig(total_gib=args.total_gib, width=args.width, **common),
            small=SmallConfig(tensors=args.small_tensors, kib=args.small_kib, **common) if args.small_tensors else None,
            s3=S3Config(mib=args.s3_mib, **common) if args.s3 else None,
            s3_small=S3SmallConfig(tensors=args.small_tensors or 2000, kib=args.small_kib, **common)
            if args.s3
            else None,
            objects=PackedConfig(
                tensors=[int(n) for n in args.objects_tensors.split(",")],
                world=args.objects_world,
                kib=args.small_kib,
                **common,
            )
            if args.objects
            else None,
            fsdp_too=not args.only,
            parent=args.dir,
        )
    except ValueError as e:
        parser.error(str(e))


def run(cases: Cases) -> None:
    if cases.fsdp_too:
        run_fsdp(cases.fsdp)
    if cases.small is not None:
        cases.small.root = os.path.join(cases.fsdp.root, "small")
        run_small(cases.small)
    if cases.objects is not None:
        cases.objects.root = os.path.join(cases.fsdp.root, "objects")
        run_objects(cases.objects)
    if cases.s3 is not None:
        run_s3(cases.s3)
        run_s3_small(cases.s3_small)


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    # SystemExit unwinds through every finally clause: ranks killed, moto stopped, scratch removed.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    cases = parse_args(argv)
    setup_logging(None)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if cases.s3 is not None and not moto_available():
        sys.exit(f"--s3 needs moto_server at {moto_path()} and boto3: pip install 'moto[server]' boto3")
    os.makedirs(cases.parent, exist_ok=True)
    cases.fsdp.root = tempfile.mkdtemp(prefix="ckpt_bench-", dir=cases.parent)
    started = time.perf_counter()
    try:
        run(cases)
    finally:
        shutil.rmtree(cases.fsdp.root, ignore_errors=True)
    log.info("done in %.1f s", time.perf_counter() - started)


if __name__ == "__main__":
    main()
