"""Verify a committed step: coverage, every shard object present, every chunk read and checksummed.

Three independent checks, so one kind of damage cannot hide another:
1. the manifest's regions tile each array exactly (no gap, no overlap, shard-aligned);
2. every shard object those regions imply exists in storage (one listing per step, no HEADs);
3. every region is read back in bounded C-order blocks: TensorStore verifies each inner chunk's
   and each shard index's crc32c as it decodes, and the crc32c of the region's raw bytes is
   compared with the one its writer recorded in the manifest (this catches a valid chunk in the
   wrong place, e.g. an object copied from another step).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c
import numpy as np

from resilient.dtypes import itemsize
from resilient.errors import IntegrityError
from resilient.layout import Box
from resilient.manifest import ArrayEntry
from resilient.storage.offline.catalog import CheckpointRef, DamagedStep, select
from resilient.storage.offline.sources import ResilientSource
from resilient.storage.offline.streaming import Pipeline, c_order_blocks
from resilient.storage.shardfile import chunk_key


@dataclass(slots=True)
class Problem:
    step: int
    fqn: str | None
    # "manifest" | "manifest-missing" | "coverage" | "missing-object" | "unreadable" | "checksum" |
    # "attempt-missing"
    kind: str
    chunk: str | None  # the shard object key (relative to the attempt), when one is to blame
    message: str

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class StepReport:
    step: int
    url: str
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "url": self.url,
            "ok": self.ok,
            "status": "ok" if self.ok else "damaged",
            "tensors": self.tensors,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
            "problems": [p.to_json() for p in self.problems],
        }


def shard_key(entry: ArrayEntry, index: tuple[int, ...]) -> str:
    """Key of a shard object relative to the attempt, in the manifest's format version."""
    return f"{entry.path}/{chunk_key(index, format_version=entry.format_version)}"


def object_of(entry: ArrayEntry, index: tuple[int, ...]) -> str | None:
    """Key (under the attempt) of the object holding a shard: the shard itself (versions 1, 2) or
    the pack the manifest names for it (version 3; None if it names none)."""
    if entry.format_version < 3:
        return shard_key(entry, index)
    ref = entry.shards.get(chunk_key(index, format_version=entry.format_version))
    return ref[0] if ref else None


def region_shards(entry: ArrayEntry, box: Box) -> list[tuple[int, ...]]:
    """Grid indices of the shards a (shard-aligned) region covers; ``[()]`` for a 0-d array."""
    ranges = [
        range(o // s, math.ceil((o + n) / s)) for o, n, s in zip(box.offsets, box.sizes, entry.shard_shape, strict=True)
    ]
    return list(itertools.product(*ranges))


def coverage_problems(entry: ArrayEntry) -> list[str]:
    """Why the regions do not tile the array on its shard grid (empty when they do)."""
    shape, shard = entry.shape, entry.shard_shape
    if math.prod(shape) == 0:
        return []
    counts = np.zeros([math.ceil(n / s) for n, s in zip(shape, shard, strict=True)], dtype=np.int32)
    out = []
    for r in entry.regions:
        off, size = r["offsets"], r["sizes"]
        aligned = all(
            o % s == 0 and n > 0 and o + n <= d and ((o + n) % s == 0 or o + n == d)
            for o, n, s, d in zip(off, size, shard, shape, strict=True)
        )
        if not aligned or len(off) != len(shape):
            out.append(f"region offsets={off} sizes={size} is not aligned to the shard grid {shard} of shape {shape}")
            continue
        counts[tuple(slice(o // s, math.ceil((o + n) / s)) for o, n, s in zip(off, size, shard, strict=True))] += 1
    gaps, twice = int((counts == 0).sum()), int((counts > 1).sum())
    if gaps or twice:
        out.append(f"{gaps} shard(s) covered by no region and {twice} by more than one")
    return out


class _RegionCheck:
    """Running crc32c of one region, fed its blocks in C order."""

    def __init__(self, entry: ArrayEntry, region: dict, blocks: int) -> None:
        self.entry, self.region, self.blocks_left = entry, region, blocks
        self.crc = 0
        self.failed = False

    @property
    def box(self) -> Box:
        return Box(tuple(self.region["offsets"]), tuple(self.region["sizes"]))


class _StepVerifier:
    def __init__(
        self, ref: CheckpointRef, block_bytes: int, budget_bytes: int, progress: Callable[[int], None] | None
    ) -> None:
        self.ref, self.block_bytes, self.progress = ref, block_bytes, progress
        self.report = StepReport(ref.step, ref.url)
        self.source = ResilientSource(ref)
        self.pipeline = Pipeline(budget_bytes)

    def problem(self, fqn: str | None, kind: str, chunk: str | None, message: str) -> None:
        self.report.problems.append(Problem(self.ref.step, fqn, kind, chunk, message))

    def run(self, fqns: list[str]) -> StepReport:
        keys = set(self.ref.store.list_keys(self.ref.attempt_key))
        # Version 3: an attempt with no object left is every pack gone (rank 0 writes no receipt),
        # reported per tensor with the pack that held it, as one lost pack is.
        if not keys and self.ref.manifest.format_version < 3:
            self.problem(
                None,
                "attempt-missing",
                None,
                f"step {self.ref.step}: the committed attempt {self.ref.url}/{self.ref.manifest.attempt} "
                "holds no objects; the step's data is gone",
            )
            return self.report
        self.source.open(fqns)
        for fqn in fqns:
            self.check_array(self.ref.manifest.arrays[fqn], keys)
        self.pipeline.drain()
        self.report.tensors = len(fqns)
        return self.report

    def check_array(self, entry: ArrayEntry, keys: set[str]) -> None:
        for why in coverage_problems(entry):
            self.problem(entry.fqn, "coverage", None, f"tensor {entry.fqn!r} at step {self.ref.step}: {why}")
        for region in entry.regions:
            box = Box(tuple(region["offsets"]), tuple(region["sizes"]))
            missing = [shard_key(entry, i) for i in region_shards(entry, box) if object_of(entry, i) not in keys]
            if missing:
                where = object_of(entry, region_shards(entry, box)[0]) if entry.format_version >= 3 else None
                held = f" (in pack {where!r})" if where else ""
                self.problem(
                    entry.fqn,
                    "missing-object",
                    missing[0],
                    f"tensor {entry.fqn!r} at step {self.ref.step}: shard object {missing[0]!r}{held} "
                    f"({len(missing)} in region offsets={region['offsets']}) does not exist under "
                    f"{self.ref.url}/{self.ref.manifest.attempt}",
                )
                continue
            self.check_region(entry, region, box)

    def check_region(self, entry: ArrayEntry, region: dict, box: Box) -> None:
        item = itemsize(entry.dtype)
        blocks = list(c_order_blocks(box, item, self.block_bytes, entry.inner_shape[0] if entry.inner_shape else 1))
        check = _RegionCheck(entry, region, len(blocks))
        for block in blocks:
            self.pipeline.add(
                block.numel * item,
                lambda b=block: self.source.read(entry.fqn, b),
                lambda data, c=check: self.fold(c, data),
                lambda err, c=check: self.fail(c, err),
            )

    def fold(self, check: _RegionCheck, data: np.ndarray) -> None:
        check.blocks_left -= 1
        if check.failed:
            return
        raw = np.require(data, requirements="C").reshape(-1).view(np.uint8)
        check.crc = crc32c.crc32c(raw, check.crc)
        self.report.bytes_read += raw.nbytes
        if self.progress:
            self.progress(raw.nbytes)
        if check.blocks_left == 0 and check.crc != check.region["crc32c"]:
            check.failed = True
            chunk = shard_key(check.entry, region_shards(check.entry, check.box)[0])
            self.problem(
                check.entry.fqn,
                "checksum",
                chunk,
                f"tensor {check.entry.fqn!r} at step {self.ref.step}: region offsets="
                f"{check.region['offsets']} reads back with crc32c {check.crc:#010x}, the manifest "
                f"records {check.region['crc32c']:#010x}: the object holds other data than was saved",
            )

    def fail(self, check: _RegionCheck, err: Exception) -> None:
        check.blocks_left -= 1
        if check.failed:
            return
        check.failed = True
        kind = "checksum" if "checksum" in str(err) else "unreadable"
        chunk = shard_key(check.entry, region_shards(check.entry, check.box)[0])
        self.problem(check.entry.fqn, kind, chunk, " ".join(str(err).split()))


def verify_step(
    ref: CheckpointRef,
    *,
    patterns: list[str] | None = None,
    block_bytes: int = 64 << 20,
    budget_bytes: int = 512 << 20,
    progress: Callable[[int], None] | None = None,
) -> StepReport:
    """Check one committed step; problems are collected, not raised (every one is reported)."""
    start = time.perf_counter()
    verifier = _StepVerifier(ref, block_bytes, budget_bytes, progress)
    report = verifier.run(select(sorted(ref.manifest.arrays), patterns))
    report.seconds = time.perf_counter() - start
    return report


def damaged_report(damaged: DamagedStep) -> StepReport:
    """The report of a step whose manifest cannot be read: nothing else of it can be checked."""
    report = StepReport(damaged.step, damaged.url)
    report.problems.append(Problem(damaged.step, None, damaged.kind, None, damaged.message))
    return report


def verify_steps(opened: list[CheckpointRef | DamagedStep], **options) -> list[StepReport]:
    """``verify_step`` for each opened step, a report for each damaged one: every step is checked
    whatever the others hold (``options`` as for ``verify_step``)."""
    reports = []
    for item in opened:
        if isinstance(item, DamagedStep):
            reports.append(damaged_report(item))
            continue
        try:
            reports.append(verify_step(item, **options))
        except IntegrityError as e:  # damage the step's own checks did not anticipate
            report = StepReport(item.step, item.url)
            report.problems.append(Problem(item.step, None, "unreadable", None, " ".join(str(e).split())))
            reports.append(report)
    return reports
