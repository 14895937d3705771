"""benchmarks/ram_bench.py's JSON lines: one per measured row (replication rate, restore times per
source and order, training overhead per snapshot cadence), with the ratios the README compares."""

from __future__ import annotations

import argparse
import json
import statistics

VARIANTS = ((0, True), (5, True), (1, True), (5, False))
"""(snapshot_every, buddy_replication) of the overhead rounds; the first is the baseline (no snapshots)."""


def print_replication(rank: int, rates: list[float], args: argparse.Namespace) -> None:
    print(
        json.dumps(
            {
                "bench": "replication_mib_per_s",
                "rank": rank,
                "state_mib": args.state_mib,
                "copies": len(rates),
                "median": round(statistics.median(rates) / 2**20, 1),
                "min": round(min(rates) / 2**20, 1),
                "max": round(max(rates) / 2**20, 1),
                "each": [round(rate / 2**20, 1) for rate in rates],
                "background_nice": args.background_nice,
            }
        ),
        flush=True,
    )


def print_restore(rank: int, restore: dict, args: argparse.Namespace) -> None:
    print(
        json.dumps(
            {
                "bench": "ram_restore",
                "rank": rank,
                "state_mib": args.state_mib,
                "persistent_load_s": round(restore["persistent_s"], 4),
                "persistent_cold_load_s": round(restore["persistent_cold_s"], 4),
                "ram_own_s": round(restore["ram_own_s"], 4),
                "ram_buddy_s": round(restore["ram_buddy_s"], 4),
                "ram_own_no_persistent_s": round(restore["ram_own_no_persistent_s"], 4),
                "ram_buddy_no_persistent_s": round(restore["ram_buddy_no_persistent_s"], 4),
                **{k: round(restore[k], 4) for k in ("ram_own_no_reinit_s", "ram_buddy_no_reinit_s") if k in restore},
                "memcpy_s": round(restore["memcpy_s"], 4),
                "persistent_over_ram_own": round(restore["persistent_s"] / restore["ram_own_s"], 2),
                "persistent_over_ram_buddy": round(restore["persistent_s"] / restore["ram_buddy_s"], 2),
                "persistent_cold_over_ram_own": round(restore["persistent_cold_s"] / restore["ram_own_s"], 2),
                "persistent_cold_over_ram_buddy": round(restore["persistent_cold_s"] / restore["ram_buddy_s"], 2),
                "persistent_cold_over_ram_own_no_persistent": round(
                    restore["persistent_cold_s"] / restore["ram_own_no_persistent_s"], 2
                ),
                "persistent_cold_over_ram_buddy_no_persistent": round(
                    restore["persistent_cold_s"] / restore["ram_buddy_no_persistent_s"], 2
                ),
                "ram_own_over_memcpy": round(restore["ram_own_s"] / restore["memcpy_s"], 2),
                # The ceiling of persistent_cold_over_ram_*: a restore cannot beat one memcpy of the state.
                "persistent_cold_over_memcpy": round(restore["persistent_cold_s"] / restore["memcpy_s"], 2),
                "buddy_source": "buddy" if rank == 1 else "own",
                **s3_fields(restore),
                "repeats": args.restore_repeats,
                "each_s": {k.removesuffix("_each"): v for k, v in restore.items() if k.endswith("_each")},
            }
        ),
        flush=True,
    )
    contention = contention_fields(restore)
    if contention:
        print(json.dumps({"bench": "ram_restore_contention", "rank": rank, **contention}), flush=True)
    rep = restore["replication"]
    print(
        json.dumps(
            {
                "bench": "ram_replication",
                "rank": rank,
                "bytes": rep.get("bytes"),
                "seconds": rep.get("seconds"),
                "mib_per_s": round(rep.get("bytes_per_s", 0) / 2**20, 1),
                "outcome": rep["outcome"],
                "snapshot_copy_s": round(restore["snapshot_copy_s"], 4),
                **({"error": rep["error"]} if "error" in rep else {}),
            }
        ),
        flush=True,
    )


def contention_fields(restore: dict) -> dict:
    """The buddy restores (with a persistent step, without one, without a reinit either) alone and
    beside a spinning process (``--contend``): wall, the job's CPU seconds, each rank's (rank 1
    fetches) and the other processes' (medians), and the ratio of the two walls."""
    if "ram_buddy_no_persistent_contended_s" not in restore:
        return {}
    out: dict = {}
    for case in ("ram_buddy", "ram_buddy_no_persistent", "ram_buddy_no_reinit"):
        if f"{case}_contended_s" not in restore:  # no_reinit: absent in lines of older runs
            continue
        for key in (case, f"{case}_contended"):
            out[f"{key}_s"] = round(restore[f"{key}_s"], 4)
            out[f"{key}_cpu_s"] = round(restore[f"{key}_cpu_s"], 4)
            out[f"{key}_others_cpu_s"] = round(restore[f"{key}_others_cpu_s"], 4)
            if f"{key}_rank_cpu_s" in restore:  # absent in lines of older runs
                out[f"{key}_rank_cpu_s"] = restore[f"{key}_rank_cpu_s"]
        out[f"{case}_contended_over_alone"] = round(restore[f"{case}_contended_s"] / restore[f"{case}_s"], 2)
    return out


def s3_fields(restore: dict) -> dict:
    """The persistent restore from the loopback S3 endpoint, when it ran (``--s3``)."""
    if "persistent_s3_s" not in restore:
        return {}
    s3 = restore["persistent_s3_s"]
    return {
        "persistent_s3_load_s": round(s3, 4),
        "persistent_s3_over_ram_own": round(s3 / restore["ram_own_s"], 2),
        "persistent_s3_over_ram_buddy": round(s3 / restore["ram_buddy_s"], 2),
        "persistent_s3_over_ram_buddy_no_persistent": round(s3 / restore["ram_buddy_no_persistent_s"], 2),
    }


def print_overhead(rank: int, overhead: dict, args: argparse.Namespace) -> None:
    """One line per variant. ``overhead`` is the median over rounds of (variant / baseline of the
    same round) - 1: each ratio compares blocks run back to back; ``mean_step_s`` and
    ``baseline_step_s`` are the medians of the per-round means (kept for older readers)."""
    base = overhead[0, True]
    for every, replication in VARIANTS[1:]:
        variant = overhead[every, replication]
        ratios = [v / b - 1 for v, b in zip(variant["step_s"], base["step_s"], strict=True)]
        drained = [v / b - 1 for v, b in zip(variant["drained_step_s"], base["drained_step_s"], strict=True)]
        print(
            json.dumps(
                {
                    "bench": "ram_overhead",
                    "rank": rank,
                    "loop_mib": args.loop_mib,
                    "batch": args.batch,
                    # Training FLOPs (6 per parameter per row) per byte of snapshotted state (fp32
                    # parameters and AdamW's two moments: 12 bytes per parameter): batch / 2. An LLM
                    # pretraining rank (16 bytes of state per parameter, FSDP over all ranks) has
                    # 0.375 x the global batch in tokens (divided by the replicas under HSDP):
                    # 10^4-10^6 for global batches of 0.25M-4M tokens.
                    "flops_per_state_byte": args.batch / 2,
                    "snapshot_every": every,
                    "buddy_replication": replication,
                    "mean_step_s": round(statistics.median(variant["step_s"]), 5),
                    "baseline_step_s": round(statistics.median(base["step_s"]), 5),
                    "overhead": round(statistics.median(ratios), 4),
                    "overhead_each": [round(r, 4) for r in ratios],
                    "overhead_min": round(min(ratios), 4),
                    "overhead_max": round(max(ratios), 4),
                    "step_s_each": [round(t, 5) for t in variant["step_s"]],
                    "baseline_step_s_each": [round(t, 5) for t in base["step_s"]],
                    "overhead_drained": round(statistics.median(drained), 4),
                    "overhead_drained_each": [round(r, 4) for r in drained],
                    "rounds": len(ratios),
                    "block_steps": args.block_steps,
                    "snapshots_taken": variant["snapshots_taken"],
                    "snapshots_attempted": variant["snapshots_attempted"],
                    "interleaved": True,
                }
            ),
            flush=True,
        )
