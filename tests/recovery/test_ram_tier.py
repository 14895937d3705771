"""The RAM tier below the trainer: node store, pairing, the one restore decision (real gloo ranks)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from resilient.errors import ConfigError
from resilient.recovery.node_store import (
    RankStore,
    SnapshotIndex,
    checksum,
    clean_stale_stores,
    first_corruption,
    layout_tensors,
    mark_store,
    tensor_view,
)
from resilient.recovery.pairing import Pairing
from resilient.recovery.ram_config import RecoveryConfig, node_store_dir
from tests.dist import run_world
from tests.recovery import ram_workers

pytestmark = pytest.mark.timeout(120)


def _write(store: RankStore, step: int, value: float, *, publish: bool = True) -> str:
    tensors = {"a": torch.full((5, 3), value), "b": torch.full((4,), value).bfloat16()}
    entries, nbytes = layout_tensors(tensors)
    slot, data = store.reserve(nbytes)
    for entry in entries:
        tensor_view(data, entry).copy_(tensors[entry.fqn])
        entry.crc32c = checksum(data, entry)
    if publish:
        store.publish(SnapshotIndex(step=step, rank=0, topology={}, tensors=entries, values={"v": value},
                                    slot=slot, nbytes=nbytes))  # fmt: skip
        store.release(slot)
    return slot


def test_pairing_puts_every_buddy_on_another_node_and_domain():
    ring = Pairing(world_size=6, ranks_per_node=2)
    assert [ring.buddy_of(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert ring.kept_by(2) == [0] and ring.kept_by(0) == [4]
    racks = Pairing(world_size=4, ranks_per_node=1, failure_domains=("a", "a", "b", "b"))
    assert [racks.buddy_of(r) for r in range(4)] == [2, 2, 0, 0]
    assert all(racks.failure_domains[racks.buddy_of(r)] != racks.failure_domains[r] for r in range(4))
    assert Pairing(world_size=4, ranks_per_node=4).buddy_of(1) is None
    with pytest.raises(ConfigError, match="must divide the world size 6"):
        Pairing(world_size=6, ranks_per_node=4)


def test_store_keeps_the_newest_and_shows_only_complete_snapshots(tmp_path):
    store = RankStore(str(tmp_path / "own" / "rank0"), keep=2)
    for step in (2, 4, 6):
        _write(store, step, float(step))
    assert sorted(store.indexes()) == [4, 6]
    _write(store, 8, 8.0, publish=False)  # copied but never published: a worker killed mid-snapshot
    reopened = RankStore(store.directory, keep=2)
    assert sorted(reopened.indexes()) == [4, 6]
    index = reopened.indexes()[6]
    data = reopened.data(index)
    assert first_corruption(index, data) is None
    assert torch.equal(tensor_view(data, index.tensors[1]), torch.full((4,), 6.0).bfloat16())
    assert len([n for n in os.listdir(store.directory) if n.startswith("slot")]) <= 4  # keep + leased + 1


def test_store_never_reuses_a_leased_or_visible_slot(tmp_path):
    store = RankStore(str(tmp_path / "r"), keep=1)
    _write(store, 1, 1.0)
    visible = store.indexes()[1].slot
    leased = _write(store, 2, 2.0, publish=False)
    third, _ = store.reserve(16)
    assert len({visible, leased, third}) == 3


def test_corruption_is_detected_and_named(tmp_path):
    store = RankStore(str(tmp_path / "r"), keep=1)
    _write(store, 3, 3.0)
    index = store.indexes()[3]
    store.data(index)[index.tensors[1].offset + 1] ^= 0x40
    assert first_corruption(index, RankStore(store.directory, keep=1).data(index)) == "crc32c mismatch in tensor 'b'"


def test_stale_stores_of_dead_runs_are_removed_and_nothing_else(tmp_path):
    mine, dead, fresh, foreign = (tmp_path / n for n in ("mine", "dead", "fresh", "foreign"))
    for d in (mine, dead, fresh):
        mark_store(str(d))
    foreign.mkdir()
    old = time.time() - 7200
    os.utime(dead / "store.json", (old, old))
    os.utime(mine / "store.json", (old, old))
    removed = clean_stale_stores(str(tmp_path), str(mine), stale_after_s=3600)
    assert removed == [str(dead)]
    assert mine.exists() and fresh.exists() and foreign.exists() and not dead.exists()


@pytest.mark.dist
def test_restore_from_own_store_and_from_buddy_after_node_loss(tmp_path, caplog):
    store_dir = str(tmp_path / "store")
    results = run_world(ram_workers.take_snapshots, 3, store_dir, [2, 4], timeout_s=90)
    for rank, result in enumerate(results):
        copied = [r["replication"] for r in result["stats"]]
        assert [c["outcome"] for c in copied] == ["copied", "copied"] and copied[0]["buddy"] == (rank + 1) % 3
        assert [r["step"] for r in result["stats"]] == [2, 4]
    secret = results[0]["secret"]
    assert {r["secret"] for r in results} == {secret}
    config = RecoveryConfig(store_dir=store_dir, ranks_per_node=1)
    shutil.rmtree(node_store_dir(config, os.path.join(store_dir, "run"), 0, 1))  # node 1 is replaced
    restored = run_world(ram_workers.restore, 3, store_dir, None, timeout_s=90)
    assert [r["source"] for r in restored] == ["own", "buddy", "own"]
    for rank, r in enumerate(restored):
        assert r["step"] == 4 and r["w"] == rank * 1000 + 4 and r["b_equal"] and r["optim_step"] == 4.0
        assert r["train"] == {"step": 4, "rank": rank}
    # The job's secret is in no file the tier wrote.
    for path in Path(store_dir).rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret.encode() not in data and bytes.fromhex(secret) not in data, path


@pytest.mark.dist
def test_corrupt_snapshot_falls_back_to_the_buddy_copy_then_to_an_older_step(tmp_path):
    store_dir = str(tmp_path / "store")
    run_world(ram_workers.take_snapshots, 2, store_dir, [2, 4], timeout_s=90)
    config = RecoveryConfig(store_dir=store_dir, ranks_per_node=1)
    run_dir = os.path.join(store_dir, "run")
    own0 = RankStore(os.path.join(node_store_dir(config, run_dir, 0, 0), "own", "rank0"), keep=2)
    index = own0.indexes()[4]
    own0.data(index)[index.tensors[0].offset] ^= 1  # rank 0's own step 4 is corrupt
    restored = run_world(ram_workers.restore, 2, store_dir, None, timeout_s=90)
    assert [(r["step"], r["source"]) for r in restored] == [(4, "buddy"), (4, "own")]
    assert restored[0]["excluded"] == [{"step": 4, "source": "own", "reason": "crc32c mismatch in tensor 'model.w'"}]
    # Now rank 0's buddy copy of step 4 (kept on node 1) is corrupt too: step 4 goes for everyone.
    kept = RankStore(os.path.join(node_store_dir(config, run_dir, 0, 1), "buddy", "rank0"), keep=2)
    kept.data(kept.indexes()[4])[index.tensors[0].offset] ^= 1
    restored = run_world(ram_workers.restore, 2, store_dir, None, timeout_s=90)
    assert [(r["step"], r["source"]) for r in restored] == [(2, "own"), (2, "own")]
    assert [r["w"] for r in restored] == [2.0, 1002.0]
    assert {e["source"] for e in restored[0]["excluded"]} == {"own", "buddy"}


@pytest.mark.dist
def test_newer_persistent_step_or_other_world_size_means_no_ram_restore(tmp_path):
    store_dir = str(tmp_path / "store")
    run_world(ram_workers.take_snapshots, 2, store_dir, [2, 4], timeout_s=90)
    newer = run_world(ram_workers.restore, 2, store_dir, 6, timeout_s=90)
    assert [(r["step"], r["source"]) for r in newer] == [(None, None), (None, None)]
    resized = run_world(ram_workers.restore, 1, store_dir, None, timeout_s=90)
    assert resized[0]["source"] is None
    assert any("another topology" in e["reason"] for e in resized[0]["excluded"])


def test_a_corrupt_index_is_skipped_and_named(tmp_path):
    store = RankStore(str(tmp_path / "r"), keep=2)
    _write(store, 1, 1.0)
    _write(store, 2, 2.0)
    path = tmp_path / "r" / "step-000000002.json"
    path.write_text(path.read_text().replace('"v": 2.0', '"v": 3.0'))  # the data cursor, say: still valid JSON
    assert sorted(store.indexes()) == [1]
    assert store.unreadable == ["step-000000002.json: index_crc32c mismatch: the index itself is corrupt"]


def test_store_directory_must_be_private(tmp_path):
    from resilient.recovery.node_store import check_private_dir

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="writable by no one else"):
        check_private_dir(str(shared))
    check_private_dir(str(tmp_path / "private"))
    assert (os.stat(tmp_path / "private").st_mode & 0o777) == 0o700


def test_snapshot_never_blocks_training_and_never_raises(tmp_path):
    ram = ram_workers.tier(0, 1, str(tmp_path / "store"))  # one process, no process group
    try:
        ram._queue.put_nowait(None)  # the worker is busy (a slow buddy copy, say)...
        ram._worker.join(5)  # ...made permanent here: the worker took the stop and left
        ram._queue.put_nowait(ram_workers)  # the queue is full and nobody takes from it
        start = time.monotonic()
        assert ram.snapshot(3, ram_workers.state_of(0, 3)) is False
        assert time.monotonic() - start < 5.0
        assert ram.stats.records[-1]["outcome"] == "skipped" and "busy" in ram.stats.records[-1]["reason"]
        ram._queue.get_nowait()
        ram._error = OSError(28, "No space left on device")
        assert ram.snapshot(4, ram_workers.state_of(0, 4)) is False
        assert "No space left on device" in ram.stats.records[-1]["reason"]
    finally:
        ram._worker = None
        ram.close()


@pytest.mark.dist
def test_missing_slot_file_falls_back_to_the_buddy_without_hanging(tmp_path):
    store_dir = str(tmp_path / "store")
    run_world(ram_workers.take_snapshots, 2, store_dir, [2], timeout_s=90)
    config = RecoveryConfig(store_dir=store_dir, ranks_per_node=1)
    own = Path(node_store_dir(config, os.path.join(store_dir, "run"), 0, 1)) / "own" / "rank1"
    for slot in own.glob("slot*.bin"):
        slot.unlink()
    restored = run_world(ram_workers.restore, 2, store_dir, None, timeout_s=90)
    assert [(r["step"], r["source"]) for r in restored] == [(2, "own"), (2, "buddy")]
    assert "FileNotFoundError" in restored[1]["excluded"][0]["reason"]


def test_a_received_copy_is_stored_under_its_own_slot_and_verifies(tmp_path):
    from types import SimpleNamespace

    from resilient.recovery.ram_tier import _BuddyHandler

    sender = RankStore(str(tmp_path / "sender"), keep=2)
    for step in (1, 2, 3):  # the sender's slot names run ahead of the receiver's
        _write(sender, step, float(step))
    index = sender.indexes()[3]
    index.rank = 0
    assert index.slot != "slot0.bin"
    kept = RankStore(str(tmp_path / "buddy" / "rank0"), keep=2)
    handler = _BuddyHandler(SimpleNamespace(pairing=Pairing(world_size=2, ranks_per_node=1), rank=1,
                                            buddy_store=lambda rank: kept))  # fmt: skip
    handler.put(0, "rank0/step-000000003", {"index": index.to_json()}, memoryview(sender.data(index).numpy()))
    copy = kept.indexes()[3]
    assert copy.slot == "slot0.bin" and first_corruption(copy, kept.data(copy)) is None
    assert copy.values == {"v": 3.0}


def test_failure_domains_come_from_the_config_and_are_checked():
    from resilient.recovery.ram_tier import RamTier

    config = RecoveryConfig(store_dir="/nonexistent", ranks_per_node=1, failure_domains=["a", "a", "b", "b"])
    tier = RamTier(config, keep=1, run_dir="run", group=0, rank=1, world_size=4, fingerprint={})
    assert tier.pairing.buddy_of(1) == 2  # the next node is in the same rack "a": skipped
    with pytest.raises(ConfigError, match="recovery.failure_domains has 2 labels for 4 nodes"):
        RamTier(RecoveryConfig(ranks_per_node=1, failure_domains=["a", "b"]), keep=1, run_dir="run", group=0,
                rank=0, world_size=4, fingerprint={})  # fmt: skip
    with pytest.raises(ConfigError, match="must be a list of strings"):
        RecoveryConfig(failure_domains="rack-a")
