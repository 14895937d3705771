"""Configuration of a Checkpointer."""

from __future__ import annotations

import os
from dataclasses import dataclass

from resilient.errors import ConfigError
from resilient.manifest import DEFAULT_INNER_CHUNK_BYTES, DEFAULT_MAX_SHARD_BYTES, MAX_SHARD_BYTES_LIMIT
from resilient.validate import check_choice, check_int, check_number


def _default_staging_bytes() -> int:
    """Half of this node's RAM, shared by the ranks on it (LOCAL_WORLD_SIZE under torchrun)."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        ram = 16 << 30
    return ram // 2 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@dataclass(kw_only=True, slots=True)
class CheckpointerConfig:
    """A Checkpointer's settings. Every field is also a key of a recipe's ``[checkpoint]`` section
    (``checkpoint.io_threads``, ...), with the same meaning, except ``metrics_path``: the trainer
    sets that one itself (``group<G>/saves.jsonl``)."""

    keep_last: int = 0
    """Committed steps to keep; 0 keeps every step (None, accepted for older callers, means the
    same). Older steps and orphan attempts go after a commit."""
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES
    """Target size of an inner (checksummed, independently readable) chunk, 64 KiB .. 256 MiB."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest shard object, 1 MiB .. 2 GiB (a pack is a ZIP with 32-bit sizes, no ZIP64)."""
    commit_timeout_s: float = 600.0
    """How long the coordinator waits for every rank's receipt (and the others for the commit)."""
    load_budget_bytes: int = 1 << 30
    """Bytes of reads kept in flight during load (bounds the extra memory a load needs)."""
    max_inflight: int = 1
    """Saves persisting in the background at once (each holds one staging buffer), 1 .. 8."""
    if_busy: str = "wait"
    """When save() finds max_inflight persists running: "wait" for the oldest, or "skip" this save."""
    staging_bytes: int = 0
    """Host memory budget for staging buffers (0: half the node's RAM / local ranks)."""
    writer: str = "thread"
    """Background persist in a "thread" or a spawned "process" (staging in shared memory).
    benchmarks/train_overhead.py on 2 CPU cores, 256 MiB saved every 10 steps, writer_nice=10:
    batch 64 (0.22 s steps): thread 24%, process 9% step overhead; batch 1024 (0.87 s steps):
    thread 1-4%, process about 1% (noise +-5%). The process costs training less under CPU
    contention (nice applies to all its threads); the thread stays the default because it starts
    instantly, needs no shared memory and works with memory:// (trainer: checkpoint.writer)."""
    writer_nice: int = 10
    """Nice value of the background writer (the whole process, or the Python writer thread), so
    persisting takes the CPU training leaves rather than competing with it; 0 = same priority."""
    io_threads: int = 4
    """Threads that write a rank's objects of a local (file://) checkpoint and make them durable,
    1 .. 64; S3 and memory:// go through TensorStore's own I/O pool."""
    metrics_path: str | None = None
    """Append one JSON line of SaveStats per save to this file."""
    close_timeout_s: float = 600.0
    """How long close() and wait() wait for saves in flight to be decided, at least: a save is
    also waited for until its decision is due (commit_timeout_s plus the decision grace,
    ``commit.decision_grace_s``, after it started), whatever this says."""
    poll_cap_s: float | None = None
    """Longest sleep, in s, between the storage polls of a commit (receipts on the coordinator,
    the decision on every other rank), 0.001 .. 60; polls back off toward it. None: by storage
    and world size: 10 ms for a local root and a small world, 0.5 s on S3, more at large worlds."""

    def __post_init__(self) -> None:
        if self.keep_last is None:
            self.keep_last = 0
        check_int("keep_last", self.keep_last, 0)
        check_int("inner_chunk_bytes", self.inner_chunk_bytes, 64 << 10, 256 << 20)
        check_int("max_shard_bytes", self.max_shard_bytes, 1 << 20, MAX_SHARD_BYTES_LIMIT)
        if self.max_shard_bytes < self.inner_chunk_bytes:
            raise ConfigError(
                f"max_shard_bytes={self.max_shard_bytes} must be >= inner_chunk_bytes={self.inner_chunk_bytes}"
            )
        nice = self.writer_nice
        # Not check_int: tests/storage/test_async.py holds this wording (the API does not change here).
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ConfigError(f"writer_nice must be an integer in [0, 19], got {self.writer_nice!r}")
        for name in ("commit_timeout_s", "close_timeout_s"):
            check_number(name, getattr(self, name), 0, open_low=True, unit="s")
        if self.poll_cap_s is not None:
            check_number("poll_cap_s", self.poll_cap_s, 0.001, 60.0, unit="s")
        check_int("load_budget_bytes", self.load_budget_bytes, 1 << 20)
        check_int("max_inflight", self.max_inflight, 1, 8)
        check_int("io_threads", self.io_threads, 1, 64)
        check_choice("if_busy", self.if_busy, ("wait", "skip"))
        check_choice("writer", self.writer, ("thread", "process"))
        check_int("staging_bytes", self.staging_bytes, 0)  # 0: automatic
        if self.staging_bytes == 0:
            self.staging_bytes = _default_staging_bytes()
