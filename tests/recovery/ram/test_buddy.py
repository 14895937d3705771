"""The buddy side (``recovery/ram/buddy.py``): what a rank stores for its buddy, and how."""

from __future__ import annotations

import pytest

from resilient.errors import ResilientError
from resilient.recovery.channel import ReplicationClient
from resilient.recovery.ram.buddy import BuddyHandler
from resilient.recovery.ram.pairing import Pairing
from resilient.recovery.ram.store import NodeStores, RankStore
from resilient.recovery.ram.view import RamView
from resilient.recovery.snapshot_format import SnapshotIndex, first_corruption
from resilient.recovery.timeline import UNTRACKED
from tests.recovery.ram.workers import write_snapshot

pytestmark = pytest.mark.timeout(60)


def _rank1_handler(tmp_path) -> BuddyHandler:
    """Rank 1's handler in a world of two one-rank nodes: it keeps rank 0's copies in
    ``tmp_path/buddy/rank0``."""

    def no_network(rank: int) -> ReplicationClient:
        raise AssertionError("the buddy handler never connects to another rank")

    stores = NodeStores(str(tmp_path), keep=2)
    pairing = Pairing(world_size=2, ranks_per_node=1)
    view = RamView(1, pairing, stores.own(1), stores, UNTRACKED, topology={}, connect=no_network)
    return BuddyHandler(view)


def test_a_received_copy_is_stored_under_its_own_slot_and_verifies(tmp_path):
    sender = RankStore(str(tmp_path / "sender"), keep=2)
    for step in (1, 2, 3):  # the sender's slot names run ahead of the receiver's
        write_snapshot(sender, step, float(step))
    index = sender.indexes()[3]
    index.rank = 0
    assert index.slot != "slot0.bin"
    kept = RankStore(str(tmp_path / "buddy" / "rank0"), keep=2)
    handler = _rank1_handler(tmp_path)
    handler.put(0, "rank0/step-000000003", {"index": index.to_json()}, memoryview(sender.data(index).numpy()))
    copy = kept.indexes()[3]
    assert copy.slot == "slot0.bin" and first_corruption(copy, kept.data(copy)) is None
    assert copy.values == {"v": 3.0}


def _rank1_keeping_step5_of_rank0(tmp_path) -> tuple[SnapshotIndex, memoryview, RankStore, BuddyHandler]:
    """Rank 0's snapshot of step 5 (index, bytes) and rank 1's handler with the store it keeps it in."""
    sender = RankStore(str(tmp_path / "sender"), keep=2)
    write_snapshot(sender, 5, 5.0)
    index = sender.indexes()[5]
    index.rank = 0
    kept = RankStore(str(tmp_path / "buddy" / "rank0"), keep=2)
    handler = _rank1_handler(tmp_path)
    return index, memoryview(sender.data(index).numpy())[: index.nbytes], kept, handler


def test_a_copy_received_in_place_is_published_only_on_commit(tmp_path):
    # reserve_put: the channel receives straight into the slot; nothing is visible before commit
    # (the MAC verified), an abort leaves nothing, and a sender that is not ours is refused.
    index, payload, kept, handler = _rank1_keeping_step5_of_rank0(tmp_path)
    header, key = {"index": index.to_json()}, "rank0/step-000000005"
    aborted = handler.reserve_put(0, key, header, index.nbytes)
    aborted.buffer[:] = payload
    aborted.abort()
    assert kept.indexes() == {}
    target = handler.reserve_put(0, key, header, index.nbytes)
    target.buffer[:] = payload
    assert kept.indexes() == {}
    target.commit()
    copy = kept.indexes()[5]
    assert first_corruption(copy, kept.data(copy)) is None and copy.values == {"v": 5.0}
    damaged = handler.reserve_put(0, key, header, index.nbytes)  # the MAC held, the sender's bytes did not
    damaged.buffer[:] = payload
    damaged.buffer[0] ^= 0xFF
    with pytest.raises(ResilientError, match="crc32c"):
        damaged.commit()
    assert sorted(kept.indexes()) == [5]  # the good copy stays, the damaged one is not published
    with pytest.raises(ResilientError, match="does not keep rank 1's snapshots"):
        handler.reserve_put(1, "rank1/step-000000005", header, index.nbytes)
    with pytest.raises(ResilientError, match="does not match its index"):
        handler.reserve_put(0, key, header, index.nbytes - 1)


def _landing(target, payload: memoryview, sizes: list[int]) -> None:
    """What the channel does: fill the buffer piece by piece, each piece shown to ``landed``."""
    offset = 0
    for size in sizes:
        piece = target.buffer[offset : offset + size]
        piece[:] = payload[offset : offset + size]
        target.landed(piece)
        offset += size
    assert offset == payload.nbytes


def test_a_copy_is_checksummed_as_it_lands_and_a_damaged_one_is_not_published(tmp_path, monkeypatch):
    index, payload, kept, handler = _rank1_keeping_step5_of_rank0(tmp_path)
    header, key = {"index": index.to_json()}, "rank0/step-000000005"
    # Pieces that cut tensors and gaps anywhere ("a": bytes 0-59, a gap, "b": 64-71, a tail).
    assert [(e.offset, e.nbytes) for e in index.tensors] == [(0, 60), (64, 8)] and index.nbytes == 128
    sizes = [7, 50, 1, 30, 40]
    passes = []
    monkeypatch.setattr("resilient.recovery.ram.buddy.first_corruption", lambda *a: passes.append(a))
    target = handler.reserve_put(0, key, header, index.nbytes)
    _landing(target, payload, sizes)
    target.commit()
    assert passes == []  # no pass over the bytes after they landed
    copy = kept.indexes()[5]
    assert first_corruption(copy, kept.data(copy)) is None and copy.values == {"v": 5.0}
    damaged = handler.reserve_put(0, key, header, index.nbytes)
    broken = bytearray(payload)
    broken[66] ^= 0x01  # in "b": the MAC held, the sender's bytes did not match their index
    _landing(damaged, memoryview(broken), sizes)
    with pytest.raises(ResilientError, match="crc32c mismatch in tensor 'b'"):
        damaged.commit()
    assert sorted(kept.indexes()) == [5] and passes == []
