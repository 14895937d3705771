"""Metrics as dataclasses, written by a sink as one JSON object per line."""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import asdict, dataclass, field

from resilient.runfiles import append_jsonl


@dataclass(slots=True)
class SaveStats:
    step: int
    rank: int
    bytes_total: int = 0  # the whole checkpoint (all ranks)
    bytes_written: int = 0  # by this rank
    snapshot_s: float = 0.0  # training blocked for this
    persist_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    outcome: str = "committed"  # committed | failed | skipped
    policy: str = "none"  # what max_inflight did to this save: none | waited | skipped
    waited_s: float = 0.0  # time save() waited for an earlier persist (if_busy="wait")

    @property
    def throughput_gib_s(self) -> float:
        busy = self.persist_s + self.commit_s
        return self.bytes_total / busy / 2**30 if busy > 0 else 0.0

    def to_json(self) -> dict:
        return {"event": "save", **asdict(self), "throughput_gib_s": round(self.throughput_gib_s, 4)}


@dataclass(slots=True)
class RestoreStats:
    step: int
    rank: int
    source: str = "persistent"
    bytes_read: int = 0
    seconds: float = 0.0
    storage_reads: int = 0
    bytes_fetched: int = 0
    """Bytes read from storage to fill ``bytes_read`` (whole inner chunks, checksums, shard indexes):
    over ``bytes_read`` it is the load's read amplification. Counted by the local-file reader; the
    TensorStore reader (S3, memory://) reports ``bytes_read`` here."""

    def to_json(self) -> dict:
        return {"event": "restore", **asdict(self)}


@dataclass(slots=True)
class JsonlSink:
    """Appends one JSON line per record to ``path`` (thread-safe) through ``runfiles.append_jsonl``,
    so a record carries ``t``, ``run_id`` and ``incarnation`` like every other run file once the
    trainer has stamped them. ``records`` holds the newest ``KEEP`` in memory (for callers and
    tests): a long run must not grow without bound."""

    KEEP = 1024
    path: str | None = None
    records: deque = field(default_factory=lambda: deque(maxlen=JsonlSink.KEEP))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, record: dict) -> None:
        with self._lock:
            self.records.append(record)
            if self.path:
                append_jsonl(os.path.abspath(self.path), record)
