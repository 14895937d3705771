"""The RAM tier's lifecycle and snapshots (``recovery/ram/tier.py``), one process."""

from __future__ import annotations

import threading
import time

import pytest

from resilient.errors import ConfigError
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram.tier import RamTier
from tests.dist import run_world
from tests.recovery.ram import workers

pytestmark = pytest.mark.timeout(120)


def test_snapshot_never_blocks_training_and_never_raises(tmp_path):
    ram = workers.tier(0, 1, str(tmp_path / "store"))  # one process, no process group
    try:
        ram._queue.put_nowait(None)  # the worker is busy (a slow buddy copy, say)...
        ram._worker.join(5)  # ...made permanent here: the worker took the stop and left
        ram._queue.put_nowait(workers)  # the queue is full and nobody takes from it
        start = time.monotonic()
        assert ram.snapshot(3, workers.state_of(0, 3)) is False
        assert time.monotonic() - start < 5.0
        assert ram.stats.records[-1]["outcome"] == "skipped" and "busy" in ram.stats.records[-1]["reason"]
        ram._queue.get_nowait()
        ram._error = OSError(28, "No space left on device")
        assert ram.snapshot(4, workers.state_of(0, 4)) is False
        assert "No space left on device" in ram.stats.records[-1]["reason"]
    finally:
        ram._worker = None
        ram.close()


def test_failure_domains_come_from_the_config_and_are_checked():
    config = RamTierConfig(store_dir="/nonexistent", ranks_per_node=1, failure_domains=["a", "a", "b", "b"])
    tier = RamTier(config, keep=1, run_dir="run", group=0, rank=1, world_size=4, fingerprint={})
    assert tier.pairing.buddy_of(1) == 2  # the next node is in the same rack "a": skipped
    with pytest.raises(ConfigError, match="recovery.failure_domains has 2 labels for 4 nodes"):
        RamTier(
            RamTierConfig(ranks_per_node=1, failure_domains=["a", "b"]),
            keep=1,
            run_dir="run",
            group=0,
            rank=0,
            world_size=4,
            fingerprint={},
        )
    with pytest.raises(ConfigError, match="must be a list of strings"):
        RamTierConfig(failure_domains="rack-a")


@pytest.mark.dist
def test_a_start_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    results = run_world(workers.start_failing_on, 2, str(tmp_path / "store"), 1, timeout_s=90)
    assert [r["type"] for r in results] == ["StorageError", "StorageError"]
    assert results[0]["message"] == results[1]["message"]
    assert results[0]["message"].startswith("[rank 1] cannot start the RAM tier under ")
    assert "recovery.store_dir" in results[0]["message"] and "203.0.113.1" in results[0]["message"]
    assert all(r["server_closed"] for r in results)  # rank 0's listening server did not outlive the failure


@pytest.mark.timeout(60)
def test_slots_are_made_off_the_training_thread(tmp_path, monkeypatch):
    # Before: the first snapshots each made a new slot file (fallocated, faulted in: ~0.8 s for
    # 256 MiB) on the training thread; now the tier's background thread has them ready.
    from resilient.recovery.ram import store as store_module
    from tests.recovery.ram.workers import state_of, tier

    made: list[str] = []
    real = store_module._Slot.__init__

    def recording(self, path: str, nbytes: int) -> None:
        made.append(threading.current_thread().name)
        real(self, path, nbytes)

    monkeypatch.setattr(store_module._Slot, "__init__", recording)
    ram = tier(0, 1, str(tmp_path / "store"))
    try:
        for step in range(1, 7):
            assert ram.snapshot(step, state_of(0, step))
            ram.wait(30)
    finally:
        ram.close()
    on_training = [name for name in made if name == threading.main_thread().name]
    assert on_training == ["MainThread"]  # the very first slot only: its size is known at the first snapshot
    assert made.count("resilient-ram-tier") == ram.keep + 1
