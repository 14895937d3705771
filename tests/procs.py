"""Process helpers for tests that launch jobs (torchrun, launchers) as subprocesses."""

from __future__ import annotations

import contextlib
import subprocess

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
