"""The run directory's contract (DESIGN §8b): every path a run writes, and how its lines are written
and read. The one place that knows these names: the trainer, the launcher, ``resilient-chaos``
and the tools all ask here.

::

    <run.dir>/
      events.jsonl            typed events of the whole job (every group's rank 0 appends)
      pids/group<G>-rank<R>   pid files; pids/lighthouse
      group<G>/metrics.jsonl  ranks.jsonl  samples.jsonl  skipped.jsonl  saves.jsonl  ram.jsonl
      group<G>/config.json  final.json  incarnation.json  hang/
      group<G>/timeline.json  the RAM tier's current timeline (recovery/timeline.py)
      ckpt/                   default checkpoint.url

JSON-lines files are appended one record per ``write`` on an ``O_APPEND`` descriptor: records from
several processes never interleave (POSIX appends are atomic per write on a local file system) and
no lock is needed. A killed writer can leave at most its own last line torn; readers skip it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from resilient.errors import ConfigError, disk_full

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
PIDS_DIR = "pids"
LIGHTHOUSE_PID = "lighthouse"
"""``pids/lighthouse``: the pid of the lighthouse the launcher started (rewritten on restart)."""
LOGS_DIR = "logs"
CHAOS_DIR = "chaos"
"""``<run.dir>/chaos/``: what ``resilient-chaos`` and its step hook exchange (arm files, digests, holds)."""
CKPT_DIR = "ckpt"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
SKIPPED_FILE = "skipped.jsonl"
"""Documents the data could not build (a real media file that does not decode): step, rank, id, reason."""
SAVES_FILE = "saves.jsonl"
RAM_FILE = "ram.jsonl"
CONFIG_FILE = "config.json"
RANKS_FILE = "ranks.jsonl"
"""``group<G>/ranks.jsonl``: every rank's step time by phase, every ``metrics.rank_every`` steps."""
INCARNATION_FILE = "incarnation.json"
"""``group<G>/incarnation.json``: the group's latest incarnation (``next_incarnation``)."""
HANG_DIR = "hang"
"""``group<G>/hang/rank<R>-<incarnation>.txt``: every thread's stack when a rank stopped stepping."""
HOOK_EVENTS_FILE = "hook_events.jsonl"
"""``<run.dir>/chaos/hook_events.jsonl``: what the chaos step hook did (holds, corruptions)."""
FINAL_DIGEST = "final.json"
"""``group<G>/final.json``: sha256 of the final full parameters and optimizer state."""
JOB_KEY_FILE = "job.key"  # the replica groups' shared heal key (recovery/channel/secret.py), mode 0600
TIMELINE_FILE = "timeline.json"
"""``group<G>/timeline.json``: run id, incarnation and timeline of the group's RAM snapshots
(``resilient.recovery.timeline``)."""

GROUP_ENV = "RESILIENT_GROUP"
"""Replica-group id of this torchrun job (0 while a run has one group)."""


# --- where ----------------------------------------------------------------------------------------


def group_id() -> int:
    """This process's replica group, from ``$RESILIENT_GROUP`` (0 when unset)."""
    value = os.environ.get(GROUP_ENV, "0")
    if not value.isdigit():
        raise ConfigError(f"environment {GROUP_ENV}={value!r} must be a non-negative integer (replica group id)")
    return int(value)


def group_dir(run_dir: str, group: int | None = None) -> str:
    """``<run.dir>/group<G>``: one replica group's metrics, samples, saves, RAM stats."""
    return os.path.join(os.path.abspath(run_dir), f"group{group_id() if group is None else group}")


def group_file(run_dir: str, name: str, group: int | None = None) -> str:
    """``<run.dir>/group<G>/<name>`` (``name``: one of the ``*_FILE`` constants)."""
    return os.path.join(group_dir(run_dir, group), name)


def events_path(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), EVENTS_FILE)


def pids_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), PIDS_DIR)


def pid_path(run_dir: str, group: int, rank: int) -> str:
    return os.path.join(pids_dir(run_dir), f"group{group}-rank{rank}")


def lighthouse_pid_path(run_dir: str) -> str:
    return os.path.join(pids_dir(run_dir), LIGHTHOUSE_PID)


def make_run_dir(run_dir: str) -> None:
    """Creates ``run_dir`` (and its parents) if need be. One that cannot be made or written at all
    (a file in its path, no permission, a read-only mount) is a setting to change: a ConfigError in
    one line; a full disk stays the OSError it is (a failure of the machine, not of the input)."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", run_dir)
    except OSError as e:
        if disk_full(e):
            raise
        raise run_dir_error(run_dir, e) from e


def run_dir_error(run_dir: str, error: OSError) -> ConfigError:
    """A first write into ``run_dir`` that failed for another reason than a full disk."""
    return ConfigError(
        f"run.dir {os.path.abspath(run_dir)} cannot be written ({error.strerror or error}: "
        f"{error.filename or run_dir}); set run.dir to a directory this user can create and write"
    )


def logs_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), LOGS_DIR)


def chaos_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), CHAOS_DIR)


def default_ckpt_url(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), CKPT_DIR)


# --- pid files ------------------------------------------------------------------------------------


def write_pid_file(path: str, pid: int | None = None) -> None:
    """Write ``pid`` (default: this process) to ``path``, replaced atomically (a restarted process
    overwrites its predecessor's file; a reader never sees a half-written number)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid() if pid is None else pid}\n")
    os.replace(tmp, path)


def read_pid_file(path: str) -> int | None:
    """The pid in ``path``; None when it is missing or not a number."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def write_pid(run_dir: str, group: int, rank: int) -> None:
    """Record this process as ``pids/group<G>-rank<R>``."""
    write_pid_file(pid_path(run_dir, group, rank))


def read_pid(run_dir: str, group: int, rank: int) -> int | None:
    return read_pid_file(pid_path(run_dir, group, rank))


# --- small JSON records ----------------------------------------------------------------------------


def write_json(path: str, record: dict[str, Any]) -> None:
    """Replace ``path`` with ``record`` durably and atomically (temp + fsync + rename + fsync of the
    directory): a crash leaves the old record or the new one, never a torn one."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing, unreadable or not an object."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# --- JSON lines -----------------------------------------------------------------------------------


_identity: dict[str, Any] = {}
"""``run_id`` and ``incarnation`` this process stamps on every record it appends (``stamp_records``)."""


def stamp_records(*, run_id: str | None, incarnation: int) -> None:
    """From now on every record this process appends carries ``t``, ``run_id`` and ``incarnation``
    (docs/observability.md): records of several runs and restarts in one directory can be told
    apart and joined. Set by the trainer once it knows them (``Trainer.resume``)."""
    _identity.update(incarnation=incarnation, **({"run_id": run_id} if run_id else {}))


def _stamped(record: dict[str, Any]) -> dict[str, Any]:
    if not _identity:
        return record
    return {"t": round(time.time(), 4), **_identity, **record}


def next_incarnation(run_dir: str, group: int) -> int:
    """This start's incarnation of ``group``: 0 the first time, one more at every start after
    (``group<G>/incarnation.json``; one writer per group, its rank 0)."""
    path = group_file(run_dir, INCARNATION_FILE, group)
    last = (read_json(path) or {}).get("incarnation")
    incarnation = last + 1 if isinstance(last, int) and not isinstance(last, bool) else 0
    write_json(path, {"incarnation": incarnation, "t": round(time.time(), 4)})
    return incarnation


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    """Append one record as one line in ONE write (see the module docstring)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(_stamped(record)) + "\n").encode())
    finally:
        os.close(fd)


def iter_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """Every complete record of ``path`` in file order (nothing when it does not exist); a torn or
    otherwise unparsable line is skipped."""
    # NotADirectoryError: a file where a directory of the path should be; nothing there either.
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    yield record


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """:func:`iter_jsonl` as a list."""
    return list(iter_jsonl(path))


def read_jsonl_by_step(path: str) -> dict[int, dict[str, Any]]:
    """Records keyed by ``step``, ascending; a step logged twice (redone after a restore) keeps its
    last line, the one that counts."""
    out = {r["step"]: r for r in iter_jsonl(path) if "step" in r}
    return dict(sorted(out.items()))


class JsonlTail:
    """Reads a JSON-lines file incrementally: each ``poll`` returns the records completed since the
    last one (a line still being written waits for its newline)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                new.append(json.loads(line))
        self.records.extend(new)
        return new


# --- the event log --------------------------------------------------------------------------------


class EventLog:
    """``<run.dir>/events.jsonl``: typed events (start, restore, quorum, heal, save, done, ...).
    Every record carries ``t`` and ``event``; a disabled log (not the group's rank 0) writes nothing.
    Events are advisory side effects: a log that cannot be opened or written is warned about once
    and writes nothing (see ``write_event``)."""

    def __init__(self, run_dir: str, *, enabled: bool) -> None:
        self.path = events_path(run_dir)
        self._fd: int | None = None
        if enabled:
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                _event_write_failed(self.path, e)

    def write(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        try:
            record = _stamped({"t": round(time.time(), 4), "event": event, **fields})
            os.write(self._fd, (json.dumps(record) + "\n").encode())
        except OSError as e:
            _event_write_failed(self.path, e)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_event(run_dir: str, event: str, **fields: Any) -> None:
    """Append one event without keeping a descriptor open (rare events: restore, done).

    Never raises OSError: an event records a decision, it never makes one. Often only rank 0
    writes (``restore_fallback``), so an ENOSPC or EROFS raised here would take rank 0 out of the
    restore while its peers wait for it in the next collective. Warned once per path."""
    path = events_path(run_dir)
    try:
        append_jsonl(path, {"t": round(time.time(), 4), "event": event, **fields})
    except OSError as e:
        _event_write_failed(path, e)


_failed_event_paths: set[str] = set()


def _event_write_failed(path: str, error: OSError) -> None:
    if path not in _failed_event_paths:
        _failed_event_paths.add(path)
        log.warning("cannot write events to %s (%s); the run goes on without them", path, error)


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """Every complete event of ``<run_dir>/events.jsonl``, in file order ([] before the first)."""
    return read_jsonl(events_path(run_dir))
