"""benchmarks/ram_bench.py's bookkeeping, without running it: the interleaving order, the per-round
overhead ratios and the S3 restore fields (their values on synthetic timings)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ram_bench  # noqa: E402
import ram_bench_report  # noqa: E402  (the benchmarks folder is not a package)


def test_rotation_gives_every_variant_every_position() -> None:
    orders = [ram_bench._rotated(ram_bench.VARIANTS, r) for r in range(len(ram_bench.VARIANTS))]
    for position in range(len(ram_bench.VARIANTS)):
        assert {order[position] for order in orders} == set(ram_bench.VARIANTS)
    assert all(sorted(order) == sorted(ram_bench.VARIANTS) for order in orders)


def test_overhead_is_the_median_of_same_round_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    # The neighbour doubles every step time in round 2: a ratio of same-round blocks does not care.
    base = {"step_s": [1.0, 2.0, 1.0], "drained_step_s": [1.0, 2.0, 1.0]}
    variant = {"step_s": [1.1, 2.2, 1.2], "drained_step_s": [1.2, 2.4, 1.2]}
    counts = {"snapshots_taken": 6, "snapshots_attempted": 6}
    overhead = {(0, True): base, **{key: {**variant, **counts} for key in ram_bench.VARIANTS[1:]}}
    args = argparse.Namespace(loop_mib=64, batch=1024, block_steps=10)
    ram_bench_report.print_overhead(0, overhead, args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["snapshot_every"], line["buddy_replication"]) for line in lines] == list(ram_bench.VARIANTS[1:])
    line = lines[0]
    assert line["overhead_each"] == [0.1, 0.1, 0.2]
    assert line["overhead"] == 0.1
    assert line["overhead_drained"] == 0.2
    assert line["mean_step_s"] == 1.2 and line["baseline_step_s"] == 1.0  # medians, the old fields kept
    assert line["rounds"] == 3 and line["interleaved"] is True
    assert line["flops_per_state_byte"] == 512  # 6 FLOPs per parameter per row over 12 bytes of fp32 state


def test_s3_fields_only_when_the_s3_restore_ran() -> None:
    restore = {"ram_own_s": 0.1, "ram_buddy_s": 0.5, "ram_buddy_no_persistent_s": 0.8}
    assert ram_bench_report.s3_fields(restore) == {}
    fields = ram_bench_report.s3_fields({**restore, "persistent_s3_s": 2.0})
    assert fields == {
        "persistent_s3_load_s": 2.0,
        "persistent_s3_over_ram_own": 20.0,
        "persistent_s3_over_ram_buddy": 4.0,
        "persistent_s3_over_ram_buddy_no_persistent": 2.5,
    }


def test_contention_line_pairs_each_buddy_restore_alone_and_beside_a_spinning_process() -> None:
    restore = {"ram_buddy_s": 0.1}
    assert ram_bench_report.contention_fields(restore) == {}
    for case, wall in (("ram_buddy", 0.15), ("ram_buddy_no_persistent", 0.25)):
        restore |= {f"{case}_s": wall, f"{case}_cpu_s": 2 * wall, f"{case}_others_cpu_s": 0.01}
        restore |= {f"{case}_contended_s": 3 * wall, f"{case}_contended_cpu_s": 2 * wall}
        restore[f"{case}_contended_others_cpu_s"] = 2 * wall
    restore["ram_buddy_no_persistent_rank_cpu_s"] = [0.2, 0.3]
    fields = ram_bench_report.contention_fields(restore)
    assert fields["ram_buddy_no_persistent_rank_cpu_s"] == [0.2, 0.3] and "ram_buddy_rank_cpu_s" not in fields
    assert fields["ram_buddy_no_persistent_s"] == 0.25 and fields["ram_buddy_no_persistent_contended_s"] == 0.75
    assert fields["ram_buddy_no_persistent_cpu_s"] == fields["ram_buddy_no_persistent_contended_cpu_s"] == 0.5
    assert fields["ram_buddy_no_persistent_contended_others_cpu_s"] == 0.5
    assert fields["ram_buddy_contended_over_alone"] == fields["ram_buddy_no_persistent_contended_over_alone"] == 3.0


def test_busy_cpu_counts_the_machines_busy_time() -> None:
    before = ram_bench._busy_cpu_s()
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:  # this process keeps one core busy
        pass
    assert ram_bench._busy_cpu_s() - before >= 0.1
