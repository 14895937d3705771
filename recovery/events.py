"""Job-wide files of a replicated run: ``<run.dir>/events.jsonl`` and ``<run.dir>/pids/``.

Several processes (rank 0 of every group) append to one events file: each line goes out in ONE
``write`` on an ``O_APPEND`` descriptor, so lines never interleave (POSIX appends are atomic per
write on a local file system) and no lock is needed. A killed writer can leave at most its own
last line torn; readers skip such a line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

EVENTS_FILE = "events.jsonl"
PIDS_DIR = "pids"


def pid_path(run_dir: str, group: int, rank: int) -> str:
    return os.path.join(os.path.abspath(run_dir), PIDS_DIR, f"group{group}-rank{rank}")


def write_pid(run_dir: str, group: int, rank: int) -> None:
    """Record this process as ``group<G>-rank<R>`` (replaced atomically when torchrun restarts it)."""
    path = pid_path(run_dir, group, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)


def read_pid(run_dir: str, group: int, rank: int) -> int | None:
    try:
        with open(pid_path(run_dir, group, rank)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


class EventLog:
    """Appends one JSON object per line, each line in a single write."""

    def __init__(self, run_dir: str, *, enabled: bool) -> None:
        self.path = os.path.join(os.path.abspath(run_dir), EVENTS_FILE)
        self._fd: int | None = None
        if enabled:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        line = (json.dumps({"t": round(time.time(), 4), "event": event, **fields}) + "\n").encode()
        os.write(self._fd, line)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """Every complete line of ``<run_dir>/events.jsonl``, in file order ([] before the first)."""
    out = []
    try:
        with open(os.path.join(os.path.abspath(run_dir), EVENTS_FILE)) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return out
