"""One job per run directory, one run per RAM store: who owns them, and refusing a second owner.

Two runs that share a node store evict each other's snapshots, and a slot can be handed to both
(one run's index then verifies over the other's bytes); two jobs that share a run directory write
one timeline record, one event log and one checkpoint root. Both are refused at start, in one line
that names the other owner.

- **Job identity** (``job_identity``): ``$RESILIENT_JOB_ID`` (the launcher and the emitted batch
  files set it), else ``$SLURM_JOB_ID`` (a requeued job keeps it), else torchrun's run id (a
  ``--standalone`` torchrun mints one; its worker restarts keep it), else this host and the parent
  process (the torchrun agent).
- **A node's RAM store** (``hold_store``): every rank of the job holds a shared ``flock`` on
  ``<store>/owner.lock`` for its life; the store is node-local, so ``flock`` is sound there. A rank
  that finds the lock held by another job's ranks (``owner.json`` names it) is refused; a store
  whose owners all exited (a crash included: the kernel drops their locks) is taken over.
- **The run directory** (``claim_run_dir``): may be on a shared file system, where locks are not
  to be trusted, so ``<run.dir>/job.json`` records the owning job's identity, host and pid, and a
  heartbeat its holder refreshes. Another job is refused while that job is alive: on the same host
  its pid runs, elsewhere its heartbeat is younger than ``ttl_s``. The same job (a requeue, a
  restarted group, another replica group) goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import threading
import time
from typing import Any

from resilient.errors import ConfigError, StorageError, disk_full
from resilient.runfiles import read_json, run_dir_error, write_json

JOB_ID_ENV = "RESILIENT_JOB_ID"
OWNER_LOCK = "owner.lock"
OWNER_FILE = "owner.json"
JOB_FILE = "job.json"
CLAIM_TTL_S = 120.0
CLAIM_SETTLE_S = 0.5  # how long a writer waits before reading the record back (claim_run_dir)
"""A run directory's record not refreshed for this long (its job on another host) is taken over."""


class StoreInUse(StorageError):
    """Another job's ranks hold a RAM store (``hold_store``)."""


def job_identity() -> str:
    """This job's identity (see the module docstring); the same on every rank and replica group."""
    for key in (JOB_ID_ENV, "SLURM_JOB_ID"):
        value = os.environ.get(key, "").strip()
        if value:
            return value
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    return f"{socket.gethostname()}-{os.getppid()}"


def launch_job_id(launch: str) -> str:
    """The identity ``resilient-train`` hands every group it starts (``JOB_ID_ENV``): the
    scheduler's where there is one, else ``launch`` (the lighthouse every node's groups share, or
    this launch's own id)."""
    return os.environ.get(JOB_ID_ENV) or os.environ.get("SLURM_JOB_ID") or f"launch-{launch}"


# --- the node's RAM store -------------------------------------------------------------------------


class StoreLock:
    """This rank's share of its job's hold on one node store (``close`` releases it)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def hold_store(root: str, job: str, run_dir: str, *, wait_s: float = 3.0) -> StoreLock:
    """Hold ``root`` for ``job`` (a shared ``flock`` beside the job's other ranks); StoreInUse
    naming the other run's directory when another job's ranks hold it. Retries for ``wait_s``: a
    peer rank of this job may be writing ``owner.json`` under the exclusive lock just then."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(root, OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    mine = {"job": job, "run_dir": os.path.abspath(run_dir), "host": socket.gethostname(), "pid": os.getpid()}
    deadline, other = time.monotonic() + wait_s, None
    try:
        while True:
            if _try(fd, fcntl.LOCK_EX):  # nobody holds it: claim, then share it with our peers
                write_json(os.path.join(root, OWNER_FILE), mine)
                fcntl.flock(fd, fcntl.LOCK_SH)
            elif not _try(fd, fcntl.LOCK_SH):  # a claim in progress
                time.sleep(0.02 + 0.03 * random.random())
                continue
            owner = read_json(os.path.join(root, OWNER_FILE)) or {}
            if owner.get("job") == job:
                return StoreLock(fd)
            other = owner
            fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05 + 0.05 * random.random())
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise StoreInUse(
        f"the RAM store {root} is in use by the run in {other.get('run_dir', '(unknown)')} (job "
        f"{other.get('job', '?')!r}, pid {other.get('pid', '?')} on {other.get('host', '?')}); give this run "
        f"its own recovery.store_dir or run.dir, or stop that run"
    )


def held(root: str) -> bool:
    """Whether some process holds ``root``'s ``owner.lock`` (a live run's store, however long it
    has not snapshotted: never removed as stale)."""
    try:
        fd = os.open(os.path.join(root, OWNER_LOCK), os.O_RDWR)
    except OSError:
        return False
    try:
        return not _try(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


def _try(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise


# --- the run directory ----------------------------------------------------------------------------


def claim_run_dir(
    run_dir: str, job: str, *, write: bool = True, ttl_s: float = CLAIM_TTL_S, settle_s: float = CLAIM_SETTLE_S
) -> RunDirClaim:
    """Record ``job`` as the owner of ``run_dir`` (ConfigError naming the owner when another live
    job has it); returns the claim, its heartbeat kept fresh until ``close`` when ``write`` (one
    rank of each group writes, every rank checks).

    Two jobs that start together may both read no live owner and both write: each writer reads the
    record again ``settle_s`` after its write, and the one whose record was overwritten is refused
    (the last writer owns it). One that still slips through (its re-read came before the other's
    write) finds the other's record at its next heartbeat: ``RunDirClaim.check`` raises then."""
    path = os.path.join(run_dir, JOB_FILE)
    record = read_json(path)
    if record is not None and record.get("job") != job and _alive(record, ttl_s):
        raise ConfigError(
            f"run.dir {os.path.abspath(run_dir)} belongs to another running job {record.get('job')!r} "
            f"(pid {record.get('pid')} on {record.get('host')}, {_age(record):.0f} s since its heartbeat); "
            f"give this job its own run.dir, or stop that one (its record is taken over {ttl_s:.0f} s after "
            f"its last heartbeat, or once its pid is gone on this host)"
        )
    claim = RunDirClaim(path, job, ttl_s)
    if write:
        _first_beat(claim, run_dir)
        time.sleep(settle_s)
        claim.check_record()
        claim.start()
    return claim


def _first_beat(claim: RunDirClaim, run_dir: str) -> None:
    """The first write into run.dir: one that cannot be made there at all (a file in its path, no
    permission, a read-only mount) is a setting to change, said in one line; a full disk is not."""
    try:
        claim.beat()
    except OSError as e:
        if disk_full(e):
            raise
        raise run_dir_error(run_dir, e) from e


def _taken(path: str, record: dict[str, Any]) -> ConfigError:
    return ConfigError(
        f"run.dir {os.path.abspath(os.path.dirname(path))} was taken by another job {record.get('job')!r} "
        f"(pid {record.get('pid')} on {record.get('host')}) while this one held it; give each job its own run.dir"
    )


def _age(record: dict[str, Any]) -> float:
    beat = record.get("heartbeat")
    return time.time() - beat if isinstance(beat, (int, float)) else float("inf")


def _alive(record: dict[str, Any], ttl_s: float) -> bool:
    if _age(record) > ttl_s:
        return False
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int):
        return _running(pid)
    return True


def _running(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class RunDirClaim:
    """A job's record in its run directory and the thread that keeps its heartbeat fresh."""

    def __init__(self, path: str, job: str, ttl_s: float) -> None:
        self.path, self.job, self.ttl_s = path, job, ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._foreign: ConfigError | None = None

    def beat(self) -> None:
        """Refresh the record as this job's (this process the one a same-host check looks for)."""
        record = {"job": self.job, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
        write_json(self.path, record)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="resilient-run-dir-claim", daemon=True)
        self._thread.start()

    def check_record(self) -> None:
        """Raise ConfigError if the record names another job (it wrote after this one)."""
        current = read_json(self.path)
        if current is not None and current.get("job") != self.job:
            raise _taken(self.path, current)

    def check(self) -> None:
        """Raise (once) what the heartbeat found: another job's record in this job's run dir."""
        foreign, self._foreign = self._foreign, None
        if foreign is not None:
            raise foreign

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            with contextlib.suppress(OSError):
                current = read_json(self.path)
                if current is not None and current.get("job") != self.job:
                    # Fatal, not quiet: two jobs now write one run dir's timeline and checkpoints.
                    self._foreign = _taken(self.path, current)
                    return
                self.beat()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
