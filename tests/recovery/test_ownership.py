"""One run per RAM store, one job per run directory (``recovery/ownership.py``).

Before: two runs configured with one ``recovery.store_dir`` shared ``<store_dir>/group0/...`` (they
evicted each other's snapshots, and a slot could be handed to both), and two jobs could run in one
run directory unnoticed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from resilient.errors import ConfigError, StorageError
from resilient.recovery import ownership
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ownership import claim_run_dir, held, hold_store, job_identity
from resilient.recovery.ram import node_store_dir
from resilient.runfiles import read_json, write_json
from tests.recovery.ram.workers import tier

pytestmark = pytest.mark.timeout(60)


def test_two_runs_configured_with_one_store_dir_get_stores_of_their_own(tmp_path):
    config = RamTierConfig(store_dir=str(tmp_path / "shm"))
    a, b = (node_store_dir(config, str(tmp_path / name), 0, 0) for name in ("run-a", "run-b"))
    assert a != b and os.path.commonpath([a, b]) == str(tmp_path / "shm")


def _hold(root: str, job: str, run_dir: str, ready, release) -> None:
    lock = hold_store(root, job, run_dir)
    ready.set()
    release.wait(30)
    lock.close()


def test_a_second_job_on_a_held_store_is_refused_naming_the_other_run(tmp_path):
    root = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(root, "job-a", str(tmp_path / "run-a"), ready, release))
    other.start()
    try:
        assert ready.wait(30)
        same = hold_store(root, "job-a", str(tmp_path / "run-a"))  # another rank of that job: shares it
        same.close()
        with pytest.raises(StorageError) as refused:
            hold_store(root, "job-b", str(tmp_path / "run-b"), wait_s=0.3)
        message = str(refused.value)
        assert "\n" not in message and f"in use by the run in {tmp_path / 'run-a'} (job 'job-a'" in message
        assert held(root)
    finally:
        release.set()
        other.join(30)
    # Its owner gone (the kernel dropped the lock), the store is taken over.
    hold_store(root, "job-b", str(tmp_path / "run-b")).close()
    assert not held(root)


def test_a_ram_tier_refuses_a_store_another_job_holds(tmp_path, monkeypatch):
    store = str(tmp_path / "shm")
    first = tier(0, 1, store)
    try:
        monkeypatch.setenv("RESILIENT_JOB_ID", "another-job")
        with pytest.raises(StorageError, match="is in use by the run in .*run \\(job "):
            tier(0, 1, store)
    finally:
        first.close()
    tier(0, 1, store).close()  # the first closed: free again


def test_a_second_job_on_one_run_dir_is_refused_and_the_same_job_goes_on(tmp_path):
    run = str(tmp_path / "run")
    first = claim_run_dir(run, "job-a")
    try:
        claim_run_dir(run, "job-a", write=False).close()  # a requeued job, another group: the same job
        with pytest.raises(ConfigError) as refused:
            claim_run_dir(run, "job-b")
        assert "\n" not in str(refused.value)
        assert f"run.dir {run} belongs to another running job 'job-a' (pid {os.getpid()}" in str(refused.value)
    finally:
        first.close()
    # Its holder's pid gone on this host: taken over at once.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = (
        (tmp_path / "run" / "job.json").read_text().replace(f'"pid": {os.getpid()}', f'"pid": {dead.stdout.strip()}')
    )
    (tmp_path / "run" / "job.json").write_text(record)
    claim_run_dir(run, "job-b").close()


def test_job_identity_prefers_the_schedulers_id(monkeypatch):
    monkeypatch.delenv("RESILIENT_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert job_identity() == "4242"
    monkeypatch.setenv("RESILIENT_JOB_ID", "j1")
    assert job_identity() == "j1"
    monkeypatch.delenv("RESILIENT_JOB_ID")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert job_identity() == "torchrun-abc"


@pytest.mark.timeout(30)
def test_two_jobs_claiming_at_once_the_overwritten_one_is_refused(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    path = os.path.join(run, "job.json")
    other = {"job": "job-b", "host": "elsewhere", "pid": 1, "heartbeat": time.time()}
    # Before: job-a read no owner, wrote, and went on while job-b (which also read no owner) wrote too.
    monkeypatch.setattr(ownership.time, "sleep", lambda s: write_json(path, other))
    with pytest.raises(ConfigError) as refused:
        claim_run_dir(run, "job-a", settle_s=0.0)
    assert "\n" not in str(refused.value)
    assert f"run.dir {run} was taken by another job 'job-b' (pid 1 on elsewhere)" in str(refused.value)
    monkeypatch.undo()
    write_json(path, {**other, "heartbeat": 0.0})  # long dead: taken over, and kept
    claim_run_dir(run, "job-a", settle_s=0.0).close()
    assert read_json(path)["job"] == "job-a"


@pytest.mark.timeout(30)
def test_the_heartbeat_turns_a_foreign_record_into_an_error(tmp_path):
    run = str(tmp_path / "run")
    claim = claim_run_dir(run, "job-a", ttl_s=0.2, settle_s=0.0)
    try:
        claim.check()  # nothing found yet
        write_json(os.path.join(run, "job.json"), {"job": "job-b", "host": "h", "pid": 7, "heartbeat": time.time()})
        # Before: the heartbeat thread saw another job's record and went quiet; nothing was raised.
        found = None
        deadline = time.monotonic() + 10
        while found is None and time.monotonic() < deadline:
            try:
                claim.check()
                time.sleep(0.02)
            except ConfigError as e:
                found = e
        assert found is not None and "taken by another job 'job-b' (pid 7 on h)" in str(found)
        claim.check()  # raised once
        assert read_json(os.path.join(run, "job.json"))["job"] == "job-b"  # not overwritten back
    finally:
        claim.close()


def test_a_run_dir_that_cannot_be_created_is_one_config_error_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = str(blocker / "run")
    with pytest.raises(ConfigError) as refused:
        claim_run_dir(run, "job-a", settle_s=0.0)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"run.dir {run} cannot be written (Not a directory")
    assert message.endswith("set run.dir to a directory this user can create and write")


def test_a_full_disk_at_the_first_claim_stays_a_disk_error(tmp_path, monkeypatch):
    def full(path, record):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(ownership, "write_json", full)
    with pytest.raises(OSError, match="No space left on device"):
        claim_run_dir(str(tmp_path / "run"), "job-a", settle_s=0.0)
