"""Which SIGTERM is a preemption, with a real torchrun under the launcher's ``run``
(``trainer/preempt.py``): the one torchrun sends on its own after a rank failed ends the survivors
at once, even inside a collective (torchrun would otherwise wait 30 s before killing them); the one
the launcher passes on still makes the ranks save the step they are at and exit 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import communicate_or_fail, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = "import sys; from resilient.trainer.launching.torchrun import run; sys.exit(run(sys.argv[1:], 20.0))"


def _launch(scenario: str, nproc: int, out: Path) -> subprocess.Popen:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    worker = ["-m", "tests.trainer.preempt_workers", scenario, str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", LAUNCHER, *torchrun, *worker]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_survivors_blocked_in_a_collective_end_within_seconds_of_torchruns_sigterm(tmp_path: Path) -> None:
    job = _launch("peer_fails", 3, tmp_path)
    _, err = communicate_or_fail(job, 90.0, "the torchrun job")
    ended = time.time()
    assert job.returncode == 1, err[-3000:]  # rank 2's failure, as torchrun reports it
    failed = _read(tmp_path, "failed")["t"]
    # torchrun notices the failure within its monitor interval, SIGTERMs the survivors and waits
    # for them; 30 s (its kill) if they wait for a step that never ends.
    assert ended - failed < 10.0, (ended - failed, err[-3000:])
    # Neither left the receive (it never completes) nor ran on: the watcher ended them there.
    assert not list(tmp_path.glob("returned-*")) and not list(tmp_path.glob("exited-*")), os.listdir(tmp_path)


def test_a_sigterm_the_launcher_passes_on_still_makes_the_ranks_save_and_exit_143(tmp_path: Path) -> None:
    job = _launch("preempted", 2, tmp_path)
    try:
        wait_until(lambda: (tmp_path / "stepping-0").exists() and (tmp_path / "stepping-1").exists(), 60.0)
    except AssertionError:
        job.kill()
        pytest.fail(f"the ranks never stepped: {job.communicate(timeout=30)[1][-3000:]}")
    job.send_signal(signal.SIGTERM)
    _, err = communicate_or_fail(job, 60.0, "the preempted job")
    # Bare torchrun stopped by a signal exits 1 (resilient-train turns it into 143 from the events).
    assert job.returncode == 1, err[-3000:]
    assert len(list(tmp_path.glob("saved-*"))) == 1, os.listdir(tmp_path)  # the stop step, saved once
    assert [_read(tmp_path, f"exited-{rank}")["code"] for rank in (0, 1)] == [143, 143], err[-3000:]
