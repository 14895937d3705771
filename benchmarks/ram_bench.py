"""The RAM tier against persistent storage, in one run: restore time, step overhead, replication rate.

Two spawned gloo ranks, each its own simulated node (``ranks_per_node=1``), so each rank's buddy
is the other. Every rank holds a state of ``--state-mib`` MiB (fp32 tensors, like params + AdamW
moments) and measures, side by side:

- ``restore``: loading that state from a committed persistent checkpoint (``Checkpointer.load``,
  local disk, page cache warm and, ``persistent_cold_load_s``, dropped), from its own node store,
  and (rank 1, its node store wiped) from its buddy over the replication channel; plus the memcpy
  floor (copying the same bytes into resident buffers); with ``--s3`` (the default when the venv
  has ``moto_server``), also from ``s3://`` on a ``moto_server`` this run starts on 127.0.0.1 and
  kills at its end (``persistent_s3_load_s``). Each is timed ``--restore-repeats`` times, the line
  gives medians. The RAM restores run with the committed step behind them, as the restore policy
  passes it (the snapshot goes straight into the state, ``ram.inplace``), without one as the
  trainer restores (``*_no_persistent_s``: in place too, its ``reinit`` behind the decision), and
  without either (``*_no_reinit_s``: checked where it lies, copied after every rank agreed);
- ``contention`` (``--contend``, the default): the buddy restores again while one process spins,
  each restore with the CPU seconds the job and the rest of the machine spent (the
  ``ram_restore_contention`` line: a CPU-bound restore's wall time is set by its neighbours);
- ``replication``: bytes/s of the buddy copy of one snapshot, both ranks copying at once (the
  ``ram_replication`` lines); ``--replication-repeats N`` more snapshots give the median of N copies
  (the ``replication_mib_per_s`` line);
- ``mac``: the channel's AES-GCM encryption and decryption (and GMAC alone, what the wire did before
  it encrypted, and HMAC-SHA256 before that) against memcpy, on one core, per frame size (the
  ``ram_mac`` lines), and the channel alone over loopback, one process, no tier or store (the
  ``ram_channel`` line);
- ``overhead``: the mean step time of a small training loop (an MLP, AdamW) with no snapshots,
  with a RAM snapshot every 5 steps and every step (publish and buddy copy in the background),
  the variants interleaved in blocks of steps, round after round (see ``overhead_bench``).

    python benchmarks/ram_bench.py [--state-mib 256] [--loop-mib 64] [--rounds 5] [--block-steps 10]
                                   [--batch 1024] [--parts restore,overhead,mac] [--restore-repeats 5]
                                   [--replication-repeats 5] [--s3 | --no-s3] [--no-contend]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from bench_s3 import moto_available, moto_path, moto_server
from ram_bench_report import VARIANTS, print_overhead, print_replication, print_restore
from ram_wire_bench import channel_bench, mac_bench

WORLD = 2
"""(snapshot_every, buddy_replication) of the loop's variants; (0, True) is the baseline: no tier."""
S3_BUCKET = "ram-bench"


def _state(mib: float, value: float) -> dict:
    per = int(mib * 2**20 / 4 / 8)
    return {"model": {f"layer{i}": torch.full((per,), value + i) for i in range(8)}, "train": {"step": 1}}


def _tier(rank: int, store: str, run_dir: str, replication: bool = True, background_nice: int = 10):
    from resilient.recovery.config import RamTierConfig
    from resilient.recovery.ram import RamTier

    config = RamTierConfig(
        store_dir=store,
        ranks_per_node=1,
        replication_timeout_s=600,
        replication=replication,
        background_nice=background_nice,
    )
    tier = RamTier(config, keep=2, run_dir=run_dir, group=0, rank=rank, world_size=WORLD, fingerprint={"bench": 1})
    tier.start()
    return tier


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _drop_page_cache(directory: str) -> None:
    """Evict the checkpoint's files from the page cache (they are fsynced, so their pages are clean
    and POSIX_FADV_DONTNEED drops them; no root needed): the next load reads the disk."""
    dist.barrier()
    for parent, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    dist.barrier()


def restore_bench(rank: int, mib: float, root: str, s3_url: str | None, repeats: int, contend: bool = True) -> dict:
    """Every restore ``repeats`` times (``<key>`` the median, ``<key>_each`` all of them); the RAM
    variants of one kind alternate, so they meet the same conditions."""
    from resilient import Checkpointer
    from resilient.recovery.config import RamTierConfig
    from resilient.recovery.ram import node_store_dir

    # Plain tensors are replicated in a checkpoint: every rank holds the same values and loads them all.
    state = _state(mib, 1.0)
    ckpt = Checkpointer(os.path.join(root, "ckpt"))
    ckpt.save(1, state).wait()
    target = _state(mib, -1.0)
    out: dict = {}
    _record(out, "persistent_s", [_timed(lambda: ckpt.load(target, step=1)) for _ in range(repeats)])
    assert torch.equal(target["model"]["layer0"], state["model"]["layer0"])
    cold = []
    for _ in range(repeats):
        _drop_page_cache(os.path.join(root, "ckpt"))
        cold.append(_timed(lambda: ckpt.load(target, step=1)))
    _record(out, "persistent_cold_s", cold)
    if s3_url is not None:
        _record(out, "persistent_s3_s", _s3_restore(s3_url, state, mib, repeats))
    dests = {k: torch.empty_like(v) for k, v in state["model"].items()}
    _timed(lambda: [dests[k].copy_(v) for k, v in state["model"].items()])  # faults the pages in: not timed
    copies = [_timed(lambda: [dests[k].copy_(v) for k, v in state["model"].items()]) for _ in range(repeats)]
    _record(out, "memcpy_s", copies)
    tier = _tier(rank, os.path.join(root, "store"), root)
    tier.snapshot(1, state)
    tier.wait(600)
    dist.barrier()  # the peer may still be copying to this rank's channel
    out["replication"] = tier.stats.records[-1]["replication"]
    out["snapshot_copy_s"] = tier.stats.records[-1]["copy_s"]
    tier.close()
    own = _tier(rank, os.path.join(root, "store"), root)
    # Committed step 1 backs the decision, or the caller's reinit does (``*_no_persistent_s``, the
    # trainer's case): each snapshot is put straight into the state as it is checked
    # (``ram.inplace``). With neither (``*_no_reinit_s``) a snapshot is checked where it lies and
    # copied only once every rank has agreed: the only safe order when a failed fetch elsewhere
    # would leave a fresh start that keeps the state's tensors as they are.
    _ram_restores(own, "own", rank, mib, state, out, repeats)
    own.close()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(
            node_store_dir(RamTierConfig(store_dir=os.path.join(root, "store"), ranks_per_node=1), root, 0, 1)
        )
    dist.barrier()
    buddy = _tier(rank, os.path.join(root, "store"), root)
    _ram_restores(buddy, "buddy", rank, mib, state, out, repeats)
    if contend:
        _contended(buddy, rank, mib, state, out, repeats)
    buddy.close()
    ckpt.close()
    return out


def _record(out: dict, key: str, seconds: list[float]) -> None:
    out[key] = statistics.median(seconds)
    out[f"{key}_each"] = [round(s, 4) for s in seconds]


def _ram_restores(
    tier, kind: str, rank: int, mib: float, state: dict, out: dict, repeats: int, suffix: str = ""
) -> None:
    """``ram_<kind>_s`` (committed step 1 behind the decision), ``ram_<kind>_no_persistent_s`` (none;
    in place, as with the trainer's reinit) and ``ram_<kind>_no_reinit_s`` (neither), each with
    ``<key>_cpu_s`` (CPU seconds both ranks spent) and ``<key>_others_cpu_s`` (what the rest of the
    machine spent meanwhile: wall time above the job's CPU over the cores is theirs)."""
    source = "buddy" if kind == "buddy" and rank == 1 else "own"
    variants = (
        (f"ram_{kind}{suffix}_s", 1, True),
        (f"ram_{kind}_no_persistent{suffix}_s", None, True),
        (f"ram_{kind}_no_reinit{suffix}_s", None, False),
    )
    times: dict[str, list[tuple[float, float, float, list[float]]]] = {key: [] for key, _, _ in variants}
    for _ in range(repeats):
        for key, persistent_step, in_place in variants:
            target = _state(mib, -1.0)
            restore = functools.partial(tier.restore, target, persistent_step, in_place=in_place)
            times[key].append(_timed_cpu(lambda: out.setdefault("restored", restore())))  # noqa: B023 (called at once)
            assert out.pop("restored").source == source
            assert torch.equal(target["model"]["layer7"], state["model"]["layer7"])
    for key, samples in times.items():
        _record(out, key, [wall for wall, _, _, _ in samples])
        out[key.removesuffix("_s") + "_cpu_s"] = statistics.median(cpu for _, cpu, _, _ in samples)
        out[key.removesuffix("_s") + "_others_cpu_s"] = statistics.median(others for _, _, others, _ in samples)
        by_rank = zip(*(ranks for _, _, _, ranks in samples), strict=True)
        out[key.removesuffix("_s") + "_rank_cpu_s"] = [round(statistics.median(r), 4) for r in by_rank]


def _busy_cpu_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _timed_cpu(fn) -> tuple[float, float, float, list[float]]:
    """(wall s, CPU s of both ranks, CPU s of everything else on the machine, CPU s of each rank)
    of ``fn`` on both ranks."""
    dist.barrier()
    mine, busy, start = resource.getrusage(resource.RUSAGE_SELF), _busy_cpu_s(), time.perf_counter()
    fn()
    dist.barrier()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = torch.zeros(WORLD, dtype=torch.float64)
    cpu[dist.get_rank()] = after.ru_utime + after.ru_stime - mine.ru_utime - mine.ru_stime
    dist.all_reduce(cpu)
    job = float(cpu.sum())
    return wall, job, max(0.0, _busy_cpu_s() - busy - job), cpu.tolist()


def _contended(tier, rank: int, mib: float, state: dict, out: dict, repeats: int) -> None:
    """The buddy restores again while one process spins at the job's priority: a neighbour taking a
    core of the two, which a shared machine has at some times and not at others."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if rank == 0 else None
    try:
        _ram_restores(tier, "buddy", rank, mib, state, out, repeats, suffix="_contended")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def _s3_restore(url: str, state: dict, mib: float, repeats: int) -> list[float]:
    """Save ``state`` to ``url`` (the loopback moto_server the parent started) and time both ranks
    loading it back at once, as a job restarting from the persistent tier would."""
    from resilient import Checkpointer

    with Checkpointer(url) as ckpt:
        ckpt.save(1, state).wait()
        target = _state(mib, -1.0)
        seconds = [_timed(lambda: ckpt.load(target, step=1)) for _ in range(repeats)]
    assert torch.equal(target["model"]["layer7"], state["model"]["layer7"])
    return seconds


def replication_bench(
    rank: int, mib: float, repeats: int, root: str, background_nice: int, warmup: int = 3
) -> list[float]:
    """Bytes/s of ``repeats`` buddy copies of a ``mib`` MiB snapshot, both ranks copying at once,
    after ``warmup`` copies that are not counted: those create the store's slot files (tmpfs page
    faults on both ends), which a long run pays once; afterwards slots are reused.

    Nothing else runs in the job meanwhile, so the tier's niced threads have the cores, unless the
    machine is shared (then ``--background-nice 0`` measures the channel rather than the neighbours)."""
    state = _state(mib, 2.0)
    tier = _tier(rank, os.path.join(root, "store"), root, background_nice=background_nice)
    rates = []
    for step in range(1, warmup + repeats + 1):
        dist.barrier()  # both ranks copy at once, as after a real snapshot
        tier.snapshot(step, state)
        tier.wait(600)
        replication = tier.stats.records[-1]["replication"]
        assert replication["outcome"] == "copied", replication
        if step > warmup:
            rates.append(replication["bytes_per_s"])
    dist.barrier()  # the peer may still be copying to this rank's channel
    tier.close()
    return rates


def _rotated(items: tuple, round_: int) -> list:
    """Round r starts with item r mod n: no variant always runs first, or always after the same one
    (whose leftovers, dirty pages and a draining background copy, it would meet)."""
    shift = round_ % len(items)
    return [*items[shift:], *items[:shift]]


def overhead_bench(rank: int, mib: float, rounds: int, block_steps: int, batch: int, root: str) -> dict:
    """Step times of every variant in interleaved blocks: each round runs ``block_steps`` steps of
    each variant in turn (both ranks the same variant at once), so a baseline and a variant are
    measured seconds apart, never in different phases of a noisy neighbour's run. Round 0 is an
    untimed warm-up of at least 10 steps: two snapshots at every 5, which create both of the tier's
    slot files (``keep=2``; tmpfs page faults a long run pays once). Each variant keeps its model,
    optimizer and tier across rounds, so its step counter (and its snapshot cadence) runs on.

    A block ends by draining its tier (``wait``) before the next variant starts, so no variant pays
    for another's background copy; per block we keep the mean in-loop step time (what training
    sees while the copy overlaps) and the block's wall time including that drain, divided by the
    steps (the whole cost of the block when, as here, no core is idle to absorb background work)."""
    from resilient.recovery.ram import RamTier  # noqa: F401  (import cost outside the loop)

    width = int((mib * 2**20 / 3 / 4 / 4) ** 0.5)
    loops = {}
    for every, replication in VARIANTS:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(4)))
        store = os.path.join(root, f"loop{every}{replication}")
        loops[every, replication] = {
            "model": model,
            "opt": torch.optim.AdamW(model.parameters(), lr=1e-4),
            "x": torch.randn(batch, width),
            "tier": _tier(rank, store, root, replication) if every else None,
            "step": 0,
            "taken": 0,
            "attempted": 0,
        }
    results: dict = {key: {"step_s": [], "drained_step_s": []} for key in VARIANTS}
    for round_ in range(rounds + 1):
        for key in _rotated(VARIANTS, round_):
            step_s, drained_s, taken, attempted = _block(
                loops[key], key[0], block_steps if round_ else max(block_steps, 10)
            )
            if round_ > 0:
                results[key]["step_s"].append(step_s)
                results[key]["drained_step_s"].append(drained_s)
                loops[key]["taken"] += taken
                loops[key]["attempted"] += attempted
    for key, loop in loops.items():
        if loop["tier"] is not None:
            loop["tier"].close()
        results[key]["snapshots_taken"] = loop["taken"]
        results[key]["snapshots_attempted"] = loop["attempted"]
    dist.barrier()
    return results


def _block(loop: dict, every: int, steps: int) -> tuple[float, float, int, int]:
    """Run ``steps`` steps of one variant; returns (mean in-loop step s, wall s per step including
    the drain of its background work, snapshots taken, snapshots attempted)."""
    model, opt, x, tier = loop["model"], loop["opt"], loop["x"], loop["tier"]
    times, taken, attempted = [], 0, 0
    dist.barrier()
    block_start = time.perf_counter()
    for _ in range(steps):
        loop["step"] += 1
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # A snapshot on the first step of each period (1, 6, 11, ... at every 5), not the last: a
        # block's last snapshot would otherwise be drained after the clock stops, and the in-loop
        # times would never meet the background copy it overlaps in a long run.
        if tier is not None and loop["step"] % every == 1 % every:
            attempted += 1
            taken += tier.snapshot(loop["step"], {"model": model.state_dict(), "optim": opt.state_dict()["state"]})
        times.append(time.perf_counter() - start)
    if tier is not None:
        tier.wait(600)
    drained = (time.perf_counter() - block_start) / steps
    return statistics.mean(times), drained, taken, attempted


def _rank(rank: int, args: argparse.Namespace, port: int, root: str, queue, s3_url: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=1200))
    parts = args.parts.split(",")
    try:
        restore = (
            restore_bench(
                rank, args.state_mib, os.path.join(root, "restore"), s3_url, args.restore_repeats, args.contend
            )
            if "restore" in parts
            else None
        )
        rates = (
            replication_bench(
                rank, args.state_mib, args.replication_repeats, os.path.join(root, "replication"), args.background_nice
            )
            if args.replication_repeats
            else []
        )
        overhead = (
            overhead_bench(rank, args.loop_mib, args.rounds, args.block_steps, args.batch, os.path.join(root, "loop"))
            if "overhead" in parts
            else None
        )
        queue.put((rank, restore, rates, overhead))
    finally:
        dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=float, default=256, help="state per rank for the restore comparison")
    parser.add_argument("--loop-mib", type=float, default=64, help="model + AdamW state per rank in the loop")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed rounds of the loop after a warm-up; each runs every variant once"
    )
    parser.add_argument(
        "--block-steps", type=int, default=10, help="steps of one variant per round (a multiple of 5 keeps the cadence)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1024,
        help="rows per step: sets compute per state byte (batch / 2 FLOPs per byte here; a pretraining rank "
        "has 10^4-10^6; see the ram_overhead line's flops_per_state_byte)",
    )
    parser.add_argument(
        "--restore-repeats", type=int, default=5, help="times each restore is timed (its line gives the median)"
    )
    parser.add_argument(
        "--background-nice", type=int, default=10, help="recovery.background_nice for replication_mib_per_s"
    )
    parser.add_argument("--parts", default="restore,overhead,mac", help="comma-separated: restore, overhead, mac")
    parser.add_argument(
        "--replication-repeats", type=int, default=5, help="buddy copies timed for replication_mib_per_s (0: none)"
    )
    parser.add_argument(
        "--contend",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the buddy restores while one process spins (the ram_restore_contention line)",
    )
    parser.add_argument(
        "--s3",
        action=argparse.BooleanOptionalAction,
        default=moto_available(),
        help="also restore from S3 on a loopback moto_server (default: on when the venv has moto_server)",
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.s3 and not moto_available():
        raise SystemExit(f"--s3 needs moto_server at {moto_path()} and boto3: pip install 'moto[server]' boto3")
    if args.rounds < 1 or args.block_steps < 1 or args.restore_repeats < 1:
        raise SystemExit(
            f"--rounds, --block-steps and --restore-repeats must be >= 1, got {args.rounds}, {args.block_steps} "
            f"and {args.restore_repeats}"
        )
    if "mac" in args.parts.split(","):
        for line in [*mac_bench(), channel_bench()]:
            print(json.dumps(line), flush=True)
    if args.s3 and "restore" in args.parts.split(","):
        # The ranks inherit the AWS_* environment pointing at the endpoint; it is killed on leaving.
        with moto_server() as endpoint:
            import boto3

            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=S3_BUCKET)
            results = _run_ranks(args, f"s3://{S3_BUCKET}/restore")
    else:
        results = _run_ranks(args, None)
    for rank, restore, rates, overhead in results:
        if rates:
            print_replication(rank, rates, args)
        if restore is not None:
            print_restore(rank, restore, args)
        if overhead is not None:
            print_overhead(rank, overhead, args)


def _run_ranks(args: argparse.Namespace, s3_url: str | None) -> list[tuple]:
    """Spawn the two ranks, collect their results (sorted by rank); scratch removed on the way out."""
    root = tempfile.mkdtemp(prefix="ram_bench-")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from resilient.dist import free_port

    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, root, queue, s3_url)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = []
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=5))
            except Exception:  # queue.Empty: is everyone still alive?
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
        results.sort(key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
