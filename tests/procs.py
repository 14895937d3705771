"""Process helpers for tests that launch jobs (torchrun, launchers) as subprocesses, and the poll
that waits for what a process or thread does."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable

import psutil


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process under it: torchrun's workers live in sessions of their
    own, so killing the launcher alone would orphan them."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.kill()


def communicate_or_fail(proc: subprocess.Popen, timeout_s: float, what: str = "the job") -> tuple[str, str]:
    """``proc``'s (stdout, stderr) once it exits; past ``timeout_s`` its whole tree is killed and
    the test fails with the tail of both (stderr is "" when it was not piped)."""
    import pytest

    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"{what} did not finish within {timeout_s} s\n{(stdout or '')[-4000:]}\n{(stderr or '')[-3000:]}")
    return stdout or "", stderr or ""


def wait_until(condition: Callable[[], object], timeout_s: float = 20.0) -> None:
    """Poll ``condition`` until it is true; past ``timeout_s`` the test fails."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.02)
