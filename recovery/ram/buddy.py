"""The buddy side of the RAM tier: what a rank serves over the replication channel, the secret the
channel is keyed with, and the address it listens on.

Rank r's snapshots are copied to ``pairing.buddy_of(r)`` on another node; that rank's
``BuddyHandler`` stores each copy only after checking it (sender, key and size against the
pairing and its index; its bytes by the channel's MAC and every tensor's crc32c), and serves it back
only to the rank it belongs to (a snapshot belongs to the rank it was taken on: that rank's shard
of the state, whichever node that rank runs on now).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from typing import TYPE_CHECKING

import torch

from resilient import dist as rdist
from resilient.errors import ConfigError, ResilientError
from resilient.recovery.channel.handler import PutTarget
from resilient.recovery.channel.secret import SECRET_ENV, job_secret
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram.store import RankStore
from resilient.recovery.snapshot_format import CrcAsItLands, SnapshotIndex, first_corruption

if TYPE_CHECKING:
    from resilient.recovery.ram.tier import RamTier

# Domain separation: the heal channel is keyed with the job secret itself.
RAM_KEY_LABEL = b"resilient/ram/v1/group/"


def snapshot_key(rank: int, step: int) -> str:
    """The channel key of ``rank``'s snapshot of ``step``."""
    return f"rank{rank}/step-{step:09d}"


class BuddyHandler:
    """Serves the replication channel from this rank's node store."""

    def __init__(self, tier: RamTier) -> None:
        self._tier = tier

    def _checked_index(self, sender_rank: int, key: str, header: dict, nbytes: int) -> SnapshotIndex:
        """The copy's index, once sender, key and size agree with it and with the pairing."""
        tier = self._tier
        if tier.pairing.buddy_of(sender_rank) != tier.rank:
            raise ResilientError(f"rank {tier.rank} does not keep rank {sender_rank}'s snapshots")
        index = SnapshotIndex.from_json(header["index"])
        if index.rank != sender_rank or key != snapshot_key(sender_rank, index.step) or nbytes != index.nbytes:
            raise ResilientError(f"copy {key} from rank {sender_rank} does not match its index")
        return index

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        index = self._checked_index(sender_rank, key, header, len(payload))
        store = self._tier.buddy_store(sender_rank)
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
        store = self._tier.buddy_store(sender_rank)
        slot, data = store.reserve(index.nbytes)

        def commit() -> None:
            # Every piece passed through ``crc`` when the channel received them; a caller that
            # filled the buffer itself gets the pass over the bytes.
            checked = crc if crc.received == index.nbytes else None
            _publish_verified(store, index, slot, data, f"copy {key} from rank {sender_rank}", checked)

        return PutTarget(memoryview(data.numpy())[: index.nbytes], commit, lambda: store.release(slot), crc)

    def get(self, requester_rank: int, key: str) -> tuple[dict, memoryview] | None:
        tier = self._tier
        rank_part, _, step_part = key.partition("/")
        if rank_part != f"rank{requester_rank}":
            raise ResilientError(f"rank {requester_rank} may fetch only its own snapshots, not {key}")
        step = int(step_part.removeprefix("step-"))
        # The copy kept for it, else the own snapshot it left here under another rank numbering.
        for store in tier.copies_of(requester_rank):
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


def shared_secret(run_dir: str, group: int) -> bytes:
    """The channel key of replica group ``group``, the same on every rank (collective: a check).

    Derived on every rank from the job secret (``recovery.channel.secret``) and never sent: the
    group's process group runs over plain TCP across nodes, so a key sent on it could be read off
    the wire. Each group gets its own key, so a buddy copy cannot be replayed into another group.
    Every rank then shares a fingerprint of its key (HMAC of a fixed label: it reveals nothing of the
    key), so ranks whose job secret differs (a node that made its own job.key) fail here, together,
    with one line, rather than refusing each other's copies later.
    """
    keys: list[bytes] = []

    def derive() -> str:
        key = hmac.new(job_secret(run_dir), RAM_KEY_LABEL + str(group).encode(), hashlib.sha256).digest()
        keys.append(key)
        return hmac.new(key, b"fingerprint", hashlib.sha256).hexdigest()[:16]

    fingerprints = rdist.agree(derive, what="RAM tier channel key")
    if len(set(fingerprints)) > 1:
        ranks = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        raise ConfigError(
            f"ranks {ranks} hold another job secret than rank 0 (run dir {run_dir}): give every "
            f"node the same ${SECRET_ENV}, or a run.dir on a filesystem every node shares"
        )
    return keys[0]


def bind_host(config: RamTierConfig) -> str:
    """``recovery.bind_host``, else the local address of the interface that reaches the job's master."""
    if config.bind_host:
        return config.bind_host
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    # The job's own network: connecting a UDP socket sends nothing, and gethostname() can resolve
    # to 127.0.1.1.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(master), port))
        return probe.getsockname()[0]
