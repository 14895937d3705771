"""How a replica-group job stops, end to end (2 groups x 1 rank of the tiny recipe, a real
lighthouse): a SIGTERM to the launcher stops every group after one and the same step, which one
group commits, every group sees committed, the launcher exits 143 and the next start resumes there;
an error no restart fixes in one group (a full disk) ends every group at once with exit 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.runfiles import read_events
from tests.procs import communicate_or_fail

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
PACE = "tests.recovery.ram_hooks:pace"


def _launch(run_dir: Path, steps: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    sets = [
        f"run.dir={run_dir}",
        f"run.steps={steps}",
        "parallel.dp_shard=1",
        "parallel.tp=1",
        "checkpoint.persist_every=1000",  # whatever is committed before the last step, the stop saved
        f'run.step_hooks=["{PACE}"]',
    ]
    command = [sys.executable, "-m", "resilient.tools.train", "--replica-groups", "2", "--nproc-per-group", "1"]
    command += ["--config", TINY, *[a for s in sets for a in ("--set", s)]]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "RESILIENT_TEST_STEP_SLEEP": "0.2", **(env or {})}
    full_env.pop("RESILIENT_GROUP", None)
    return subprocess.Popen(command, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_until(proc: subprocess.Popen, done, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = communicate_or_fail(proc, 60, "resilient-train")
            pytest.fail(f"{what} (exit {proc.returncode})\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.2)


def _steps_together(run_dir: Path) -> int:
    return len([e for e in read_events(str(run_dir)) if e["event"] == "step" and e.get("participants") == 2])


@pytest.mark.timeout(400)
def test_a_preempted_replica_job_stops_every_group_at_one_committed_step_and_resumes_there(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, 500)
    _wait_until(proc, lambda: _steps_together(run_dir) >= 6, 200, "the groups did not train together")
    proc.send_signal(signal.SIGTERM)
    out, err = communicate_or_fail(proc, 150, "resilient-train")
    assert proc.returncode == 143, err[-4000:]
    stops = [e for e in read_events(str(run_dir)) if e["event"] == "preempted"]
    assert sorted(e["group"] for e in stops) == [0, 1], stops
    (stop,) = {e["step"] for e in stops}  # one step for both groups
    assert all(e["committed"] and e["signal"] == "SIGTERM" for e in stops), stops
    assert sum(e["wrote"] for e in stops) == 1, stops  # written once, by one group
    assert Checkpointer(str(run_dir / "ckpt")).steps() == [stop]
    # The next start resumes from the stop step, in both groups, and finishes the run.
    resumed = _launch(run_dir, stop + 2)
    _, err = communicate_or_fail(resumed, 200, "resilient-train")
    assert resumed.returncode == 0, err[-4000:]
    after = [e for e in read_events(str(run_dir)) if e["event"] == "start" and e["t"] > max(e["t"] for e in stops)]
    # From storage at the stop step; a group that joins late heals from a peer that is past it.
    assert {e["step"] for e in after if e["source"] != "peer"} == {stop}, after
    assert Checkpointer(str(run_dir / "ckpt")).steps()[-1] == stop + 2


@pytest.mark.timeout(300)
def test_a_full_disk_in_one_group_ends_every_group_with_exit_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Group 1 meets a full disk at its first step: final, a restart would meet it again.
    proc = _launch(run_dir, 500, {"RESILIENT_FAULTS": "trainer.compute=enospc@group1"})
    out, err = communicate_or_fail(proc, 200, "resilient-train")
    assert proc.returncode == 1, err[-4000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "No space left on device" in lines[0], err[-4000:]
    events = read_events(str(run_dir))
    assert [e["event"] for e in events if e["event"] == "final_error"] == ["final_error"]
    # Group 1 was not restarted into the same error, and group 0 did not train on to the end.
    assert [e["attempt"] for e in events if e["event"] == "joining" and e["group"] == 1] == [0], events
    assert not [e for e in events if e["event"] == "done"], events
