"""The job's rank processes as the fault injections see them: alive by pid, and stopped."""

from __future__ import annotations

import contextlib
import os
import time

import psutil

from resilient.runfiles import read_pid


def alive_rank_pid(run_dir: str, group: int, rank: int) -> int | None:
    """The pid of ``rank`` of ``group`` while it is a live trainer process, else None."""
    pid = read_pid(run_dir, group, rank)
    if pid is None:
        return None
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE and "resilient.trainer" in " ".join(p.cmdline()):
            return pid
    return None


def wait_stopped(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until every thread of every pid is stopped (SIGSTOP is delivered asynchronously, and a thread
    inside a system call stops only when it returns); the pids not stopped in time."""
    deadline = time.monotonic() + timeout_s
    pending = list(pids)
    while pending and time.monotonic() < deadline:
        pending = [pid for pid in pending if not _all_threads_stopped(pid)]
        if pending:
            time.sleep(0.01)
    return pending


def _all_threads_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: it writes nothing more
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True
