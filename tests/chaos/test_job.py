"""The end-of-run census finds every process left in the launcher's session, even one the 50 ms
poll never saw (started and reparented between two polls)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from resilient.chaos.job import JobProcess

pytestmark = [pytest.mark.timeout(60)]

# A launcher that starts a child which outlives it, and exits at once.
_LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
"""


def test_leftovers_lists_processes_of_the_launchers_session_it_never_saw() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    orphan = int(launcher.stdout.readline())
    launcher.wait(timeout=30)
    proc = JobProcess.__new__(JobProcess)  # only the census: no job is launched
    proc.proc, proc.seen = launcher, {}
    try:
        leftovers = proc.leftovers(wait_s=0.0)
        assert [item["pid"] for item in leftovers] == [orphan]
        assert "time.sleep(60)" in leftovers[0]["cmdline"]
        proc.kill_leftovers(leftovers)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(orphan) and psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the leftover was not killed"
            time.sleep(0.05)
    finally:
        launcher.stdout.close()
        if psutil.pid_exists(orphan):
            psutil.Process(orphan).kill()
