"""A rank killed while taking a batch leaves no traceback from its orphaned loader worker."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_a_rank_killed_mid_handoff_leaves_no_worker_traceback() -> None:
    """Issue 13 item 13: the demo's RAM-tier phase printed a raw ConnectionResetError traceback
    from multiprocessing/resource_sharer.py, written by the killed rank's DataLoader worker."""
    # The worker holds the pipes until it notices its parent is gone (torch checks every 5 s):
    # reading them to the end waits for it, so its last word is in what we read.
    done = subprocess.run(
        [sys.executable, "-m", "tests.trainer.data.killed_rank"], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout == "connected to the worker's fd listener\n"
    assert done.stderr == ""
