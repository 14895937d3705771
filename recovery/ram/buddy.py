"""The buddy side of the RAM tier: what a rank serves over the replication channel.

Rank r's snapshots are copied to ``pairing.buddy_of(r)`` on another node; that rank's
``BuddyHandler`` stores each copy only after checking it (sender, key and size against the
pairing and its index; its bytes by the channel's MAC and every tensor's crc32c), and serves it back
only to the rank it belongs to (a snapshot belongs to the rank it was taken on: that rank's shard
of the state, whichever node that rank runs on now).
"""

from __future__ import annotations

import torch

from resilient.errors import ResilientError
from resilient.recovery.channel import PutTarget
from resilient.recovery.ram.store import RankStore
from resilient.recovery.ram.view import RamView
from resilient.recovery.snapshot_format import CrcAsItLands, SnapshotIndex, first_corruption


def snapshot_key(rank: int, step: int) -> str:
    """The channel key of ``rank``'s snapshot of ``step``."""
    return f"rank{rank}/step-{step:09d}"


class BuddyHandler:
    """Serves the replication channel from this rank's node store (``view``: the tier's, once started)."""

    def __init__(self, view: RamView) -> None:
        self._view = view

    def _checked_index(self, sender_rank: int, key: str, header: dict, nbytes: int) -> SnapshotIndex:
        """The copy's index, once sender, key and size agree with it and with the pairing."""
        view = self._view
        if view.pairing.buddy_of(sender_rank) != view.rank:
            raise ResilientError(f"rank {view.rank} does not keep rank {sender_rank}'s snapshots")
        index = SnapshotIndex.from_json(header["index"])
        if index.rank != sender_rank or key != snapshot_key(sender_rank, index.step) or nbytes != index.nbytes:
            raise ResilientError(f"copy {key} from rank {sender_rank} does not match its index")
        return index

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        index = self._checked_index(sender_rank, key, header, len(payload))
        store = self._view.stores.kept(sender_rank)
        slot, data = store.reserve(index.nbytes)
        try:
            data.numpy()[:] = payload
        except BaseException:
            store.release(slot)
            raise
        _publish_verified(store, index, slot, data, f"copy {key} from rank {sender_rank}")

    def reserve_put(self, sender_rank: int, key: str, header: dict, nbytes: int) -> PutTarget:
        """Receive the copy straight into a slot of the buddy store (no bounce buffer, no memcpy) and
        publish it once the channel verified its MAC and every tensor's crc32c verifies: the MAC
        proves the bytes are the ones sent, not that the sender's memory still matched its index,
        and a copy kept as protection must restore. The crc32c is taken piece by piece as the
        payload lands (``CrcAsItLands``), not in a pass of its own afterwards (``ram_bench``'s
        replication rate; figures in benchmarks/README.md, "Choices in the code")."""
        index = self._checked_index(sender_rank, key, header, nbytes)
        crc = CrcAsItLands(index)  # refuses overlapping tensors before a slot is leased
        store = self._view.stores.kept(sender_rank)
        slot, data = store.reserve(index.nbytes)

        def commit() -> None:
            # Every piece passed through ``crc`` when the channel received them; a caller that
            # filled the buffer itself gets the pass over the bytes.
            checked = crc if crc.received == index.nbytes else None
            _publish_verified(store, index, slot, data, f"copy {key} from rank {sender_rank}", checked)

        return PutTarget(memoryview(data.numpy())[: index.nbytes], commit, lambda: store.release(slot), crc)

    def get(self, requester_rank: int, key: str) -> tuple[dict, memoryview] | None:
        rank_part, _, step_part = key.partition("/")
        if rank_part != f"rank{requester_rank}":
            raise ResilientError(f"rank {requester_rank} may fetch only its own snapshots, not {key}")
        step = int(step_part.removeprefix("step-"))
        # The copy kept for it, else the own snapshot it left here under another rank numbering.
        for store in self._view.copies_of(requester_rank):
            index = store.indexes().get(step)
            if index is not None and index.rank == requester_rank:
                return {"index": index.to_json()}, memoryview(store.data(index).numpy())
        return None


def _publish_verified(
    store: RankStore, index: SnapshotIndex, slot: str, data: torch.Tensor, what: str, crc: CrcAsItLands | None = None
) -> None:
    """Publish the copy in ``slot`` if every tensor's crc32c verifies (as taken by ``crc`` while it
    landed, else read from ``data``); the slot is released either way."""
    try:
        reason = crc.corruption() if crc is not None else first_corruption(index, data)
        if reason is not None:
            raise ResilientError(f"{what}: {reason}")
        index.slot = slot  # where the bytes are HERE (to_json re-computes the index checksum)
        store.publish(index)
    finally:
        store.release(slot)
