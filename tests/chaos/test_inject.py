"""kill_node against real processes: freeze the node's ranks, wipe its RAM store, kill them; no
store to wipe is a failed fault that kills nothing. The ranks are stand-ins (sleeping Pythons whose
command line names resilient.trainer, as the injector checks), so no job runs."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from resilient.chaos.inject import FaultRecord, advance
from resilient.chaos.job import job_node_store_dir, job_store_root
from resilient.chaos.scenario import REPO_ROOT, FaultSpec
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram import run_dir_key

pytestmark = [pytest.mark.timeout(60)]


def test_kill_node_wipes_the_store_of_frozen_ranks_then_kills_them(node) -> None:
    ctx, start_rank = node
    store = job_node_store_dir(ctx.config, ctx.job.run_dir, 0, 0)
    other_store = job_node_store_dir(ctx.config, ctx.job.run_dir, 0, 1)
    victim, survivor = start_rank(0, store), start_rank(1, other_store)
    deadline = time.monotonic() + 20
    while not (os.path.isdir(store) and os.path.isdir(other_store)) and time.monotonic() < deadline:
        time.sleep(0.05)
    record = FaultRecord(spec=FaultSpec(kind="kill_node", at_step=9, group=0, node=0))
    advance(record, ctx, t_first_commit=None)
    assert record.state == "done", record.note
    assert victim.wait(timeout=10) == -9
    assert not os.path.exists(store), "a frozen rank cannot recreate what was wiped"
    assert survivor.poll() is None and os.path.isdir(other_store), "the other node is untouched"
    assert record.extra["store"] == store and record.extra["store_wiped"] is True
    assert record.killed == [{"group": 0, "rank": 0, "pid": victim.pid}]
    assert record.rejoin == {0: 1} and record.t_injected is not None and record.at_step == 9


def test_kill_node_without_a_store_fails_and_kills_nothing(node) -> None:
    ctx, start_rank = node
    victim = start_rank(0, "/nonexistent-dir/never-created")
    start_rank(1, "/nonexistent-dir/never-created")
    record = FaultRecord(spec=FaultSpec(kind="kill_node", at_step=9, group=0, node=0))
    advance(record, ctx, t_first_commit=None)
    assert record.state == "failed"
    assert "RAM store" in record.note and "does not exist" in record.note and "memory_every=2" in record.note
    assert record.killed == [] and record.t_injected is None
    time.sleep(0.2)
    assert victim.poll() is None, "nothing was killed"


def test_a_relative_store_dir_resolves_against_the_repo_like_the_job(tmp_path: Path, monkeypatch) -> None:
    """The job runs with cwd = the repo root; the harness may run anywhere."""
    monkeypatch.chdir(tmp_path)
    config = SimpleNamespace(recovery=RamTierConfig(store_dir="runs/ram"))
    key = run_dir_key("/r")  # stores are keyed by run under any store_dir
    assert job_store_root(config, "/r") == str(REPO_ROOT / "runs" / "ram" / key)
    assert job_node_store_dir(config, "/r", 1, 2) == str(REPO_ROOT / "runs" / "ram" / key / "group1" / "node2")
    absolute = SimpleNamespace(recovery=RamTierConfig(store_dir=str(tmp_path / "ram")))
    assert job_store_root(absolute, "/r") == str(tmp_path / "ram" / key)


def test_corrupt_chunk_flips_a_shard_object_of_the_committed_attempt_only(tmp_path: Path) -> None:
    """A failed attempt beside the committed one is never read: flipping a byte there would make
    commits_verify report an undetected corruption that was never loaded."""
    import torch

    from resilient import Checkpointer
    from resilient.chaos.inject import _flip_byte

    root = str(tmp_path / "ckpt")
    Checkpointer(root).save(1, {"w": torch.arange(40000.0)}).wait()
    orphan = Path(root, "step-000000001", "attempt-orphan", "w")
    orphan.mkdir(parents=True)
    (orphan / "0").write_bytes(b"x" * 1_000_000)  # bigger than the real shard: the old pick
    ctx = SimpleNamespace(config=SimpleNamespace(checkpoint=SimpleNamespace(url=root)))
    record = SimpleNamespace(spec=SimpleNamespace(target="newest"), note=None, extra={})
    _flip_byte(ctx, record)
    (attempt,) = [
        p.name for p in Path(root, "step-000000001").iterdir() if p.name not in ("manifest.json", "attempt-orphan")
    ]
    # Format v3: the rank's shards live in its pack object under the committed attempt.
    assert record.extra["file"].startswith(f"step-000000001/{attempt}/pack-r00000-"), record.extra
    assert (orphan / "0").read_bytes() == b"x" * 1_000_000
    # The flipped byte lies in the shard's own bytes (not a ZIP header no reader reads): a load fails.
    from resilient.errors import IntegrityError

    with pytest.raises(IntegrityError):
        Checkpointer(root).load({"w": torch.zeros(40000)})
