"""The RAM tier: frequent snapshots in node memory, copied to a buddy node, restored without storage.

``snapshot(step, state)`` (training thread) copies this rank's local tensors into a reused slot of
its node store: one memcpy, the only part training waits for. A background thread then computes
the crc32c of every tensor, publishes the index (the snapshot becomes visible) and streams it to
the buddy rank over the replication channel (authenticated, never the training process group).
Only the newest snapshot is replicated: a snapshot whose copy has not started when the next one
arrives is not sent (recorded as "superseded").

``restore(state, persistent_step)`` is collective over the group and decides before anything is
loaded: every rank reports the snapshots it can supply (its own, and the copies it keeps for its
buddies), every rank computes the same choice — the newest step every rank can get from RAM, if it
is at least the newest persistent step — then each rank fetches and verifies its part (own store,
else its buddy's copy). If any rank cannot, that step is excluded for all and the decision is
taken again; the caller falls back to storage when no RAM step is left. Only snapshots taken on
the same topology (world size, ranks per node, mesh, tensor layout) are candidates.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from resilient import dist as rdist
from resilient.errors import ResilientError, StorageError
from resilient.metrics import JsonlSink
from resilient.recovery.channel import ChannelError, ReplicationClient, ReplicationServer, lower_thread_priority
from resilient.recovery.node_store import (
    RankStore,
    SnapshotIndex,
    check_private_dir,
    checksum,
    clean_stale_stores,
    first_corruption,
    layout_tensors,
    mark_store,
    tensor_view,
)
from resilient.recovery.pairing import Pairing
from resilient.recovery.ram_config import DEFAULT_STORE_ROOT, RecoveryConfig, node_store_dir, ranks_per_node, store_root
from resilient.state import Leaf, flatten_state, set_leaf

log = logging.getLogger(__name__)

SECRET_BYTES = 32


@dataclass(slots=True)
class RamRestore:
    """The outcome of one restore decision on this rank."""

    step: int | None
    source: str | None  # "own" | "buddy" | None (no RAM step: storage or fresh)
    bytes: int = 0
    seconds: float = 0.0
    excluded: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class _Job:
    index: SnapshotIndex
    data: torch.Tensor
    copy_s: float


def local_tensors(leaves: dict[str, Leaf]) -> dict[str, torch.Tensor]:
    """This rank's own bytes of every tensor leaf (a DTensor's local shard)."""
    out = {}
    for fqn, leaf in leaves.items():
        if leaf.is_tensor:
            value = leaf.value
            out[fqn] = value.to_local() if isinstance(value, DTensor) else value
    return out


def _json_values(leaves: dict[str, Leaf]) -> dict[str, Any]:
    return {fqn: leaf.value for fqn, leaf in leaves.items() if not leaf.is_tensor}


def _key(rank: int, step: int) -> str:
    return f"rank{rank}/step-{step:09d}"


class _BuddyHandler:
    """Serves the replication channel from this rank's node store."""

    def __init__(self, tier: RamTier) -> None:
        self._tier = tier

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        tier = self._tier
        if tier.pairing.buddy_of(sender_rank) != tier.rank:
            raise ResilientError(f"rank {tier.rank} does not keep rank {sender_rank}'s snapshots")
        index = SnapshotIndex.from_json(header["index"])
        if index.rank != sender_rank or key != _key(sender_rank, index.step) or len(payload) != index.nbytes:
            raise ResilientError(f"copy {key} from rank {sender_rank} does not match its index")
        store = tier.buddy_store(sender_rank)
        slot, data = store.reserve(index.nbytes)
        try:
            data.numpy()[:] = payload
            reason = first_corruption(index, data)
            if reason is not None:
                raise ResilientError(f"copy {key} from rank {sender_rank}: {reason}")
            index.slot = slot  # where the bytes are HERE (to_json re-computes the index checksum)
            store.publish(index)
        finally:
            store.release(slot)

    def get(self, requester_rank: int, key: str) -> tuple[dict, memoryview] | None:
        tier = self._tier
        rank_part, _, step_part = key.partition("/")
        if rank_part != f"rank{requester_rank}":
            raise ResilientError(f"rank {requester_rank} may fetch only its own snapshots, not {key}")
        index = tier.buddy_store(requester_rank).indexes().get(int(step_part.removeprefix("step-")))
        if index is None:
            return None
        data = tier.buddy_store(requester_rank).data(index)
        return {"index": index.to_json()}, memoryview(data.numpy())


class RamTier:
    """Node-local snapshots of one rank, replicated to its buddy; see the module docstring."""

    def __init__(
        self,
        config: RecoveryConfig,
        *,
        keep: int,
        run_dir: str,
        group: int,
        rank: int,
        world_size: int,
        fingerprint: dict[str, Any],
        stats_path: str | None = None,
    ) -> None:
        self.config, self.keep, self.group, self.rank = config, keep, group, rank
        self.pairing = Pairing(world_size, ranks_per_node(config, world_size), tuple(config.failure_domains))
        self.node = self.pairing.node_of(rank)
        self.root = store_root(config, run_dir)
        self.node_dir = node_store_dir(config, run_dir, group, self.node)
        self.own = RankStore(os.path.join(self.node_dir, "own", f"rank{rank}"), keep)
        self.topology = {"world_size": world_size, "ranks_per_node": self.pairing.ranks_per_node, "group": group,
                         **fingerprint}  # fmt: skip
        self.stats = JsonlSink(stats_path)
        self._buddy_stores: dict[int, RankStore] = {}
        self._stores_lock = threading.Lock()
        self._server: ReplicationServer | None = None
        self._client: ReplicationClient | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Open the store and the replication channel (collective: exchanges the channel addresses
        and the job's secret over the group's process group, once, before training). A failure on
        one rank is raised on every rank, so no peer waits in a collective for it."""
        secret = self._shared_secret()
        address, error = None, None
        try:
            self._open_store()
            self._server = ReplicationServer(secret, _BuddyHandler(self), host=self._bind_host(),
                                             timeout_s=self.config.replication_timeout_s,
                                             thread_nice=self.config.background_nice)  # fmt: skip
            self._server.start()
            address = tuple(self._server.address)
        except Exception as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        gathered = rdist.all_gather_object({"address": address, "error": error})
        errors = [g["error"] for g in gathered if g["error"]]
        if errors:
            if self._server is not None:
                self._server.close()
            raise StorageError(f"cannot start the RAM tier under {self.node_dir}: {errors[0]} (set "
                               f"recovery.store_dir to a writable local directory, or checkpoint.memory_every=0)")
        self._addresses = [g["address"] for g in gathered]
        self._secret = secret
        buddy = self.pairing.buddy_of(self.rank)
        if buddy is not None and self.config.replication:
            self._client = ReplicationClient(secret, tuple(self._addresses[buddy]), rank=self.rank,
                                             timeout_s=self.config.replication_timeout_s,
                                             bytes_per_s=self.config.replication_bytes_per_s)  # fmt: skip
        self._worker = threading.Thread(target=self._run, name="resilient-ram-tier", daemon=True)
        self._worker.start()

    def _open_store(self) -> None:
        check_private_dir(os.path.dirname(self.root) if self._default_root else self.root)
        mark_store(self.root)
        if self.rank == 0 and self._default_root:
            clean_stale_stores(DEFAULT_STORE_ROOT, self.root, self.config.stale_after_s)

    @property
    def _default_root(self) -> bool:
        return os.path.dirname(self.root) == DEFAULT_STORE_ROOT

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the snapshot in flight (published and replicated), stop the channel; bounded."""
        if self._worker is not None:
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                log.warning("[rank %d] RAM tier worker busy for %.0f s at close: not waiting for it", self.rank,
                            timeout_s)  # fmt: skip
            self._worker.join(timeout_s)
            if self._worker.is_alive():
                log.warning("[rank %d] RAM tier worker still running after %.0f s: abandoned", self.rank, timeout_s)
            self._worker = None
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.close()

    def _shared_secret(self) -> bytes:
        # Handed out over the group's own process group (the job's rendezvous), never written anywhere.
        secret = torch.frombuffer(bytearray(secrets.token_bytes(SECRET_BYTES)), dtype=torch.uint8).clone()
        if rdist.is_distributed():
            dist.broadcast(secret, src=0)
        return bytes(secret.tolist())

    def _bind_host(self) -> str:
        if self.config.bind_host:
            return self.config.bind_host
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        # The local address of the interface that reaches the job's master: the job's own network
        # (connecting a UDP socket sends nothing; gethostname() can resolve to 127.0.1.1).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master), port))
            return probe.getsockname()[0]

    def buddy_store(self, rank: int) -> RankStore:
        with self._stores_lock:  # server threads and the restore path share one store per rank
            store = self._buddy_stores.get(rank)
            if store is None:
                directory = os.path.join(self.node_dir, "buddy", f"rank{rank}")
                store = self._buddy_stores[rank] = RankStore(directory, self.keep)
            return store

    # -- snapshot ----------------------------------------------------------------------------

    def snapshot(self, step: int, state: dict[str, Any]) -> bool:
        """Copy this rank's state into the node store; checksum, publish and replicate in the
        background. Never blocks on the background work and never raises into training (the tier
        is an optimization): a snapshot that cannot be taken is skipped, logged and recorded.
        Returns whether it was taken."""
        start = time.perf_counter()
        reason = self._take_latched()
        if reason is None and self._queue.full():
            reason = "busy: the previous snapshot is still being published or copied to the buddy"
        if reason is None:
            try:
                job = self._copy(step, state, start)
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            log.warning("[rank %d] RAM snapshot of step %d skipped: %s", self.rank, step, reason)
            self.stats.write({"event": "ram_snapshot", "group": self.group, "rank": self.rank, "step": step,
                              "outcome": "skipped", "reason": reason})  # fmt: skip
            return False
        self._queue.put_nowait(job)
        return True

    def _copy(self, step: int, state: dict[str, Any], start: float) -> _Job:
        leaves = flatten_state(state)
        tensors = local_tensors(leaves)
        entries, nbytes = layout_tensors(tensors)
        self._check_budget(nbytes)
        slot, data = self.own.reserve(nbytes)
        try:
            for entry in entries:
                tensor_view(data, entry).copy_(tensors[entry.fqn])
        except BaseException:
            self.own.release(slot)
            raise
        index = SnapshotIndex(step=step, rank=self.rank, topology=self.topology, tensors=entries,
                              values=_json_values(leaves), slot=slot, nbytes=nbytes)  # fmt: skip
        return _Job(index, data, time.perf_counter() - start)

    def _check_budget(self, nbytes: int) -> None:
        """``recovery.max_store_bytes``: slot files in use plus the new one must fit (spare slots
        are dropped first); otherwise the snapshot is skipped, never the store overrun."""
        limit = self.config.max_store_bytes
        if not limit:
            return
        stores = [self.own, *(self.buddy_store(r) for r in self.pairing.kept_by(self.rank))]
        if sum(s.bytes_used() for s in stores) + nbytes <= limit:
            return
        for store in stores:
            store.drop_spare_slots()
        used = sum(s.bytes_used() for s in stores)
        if used + nbytes > limit:
            raise StorageError(f"recovery.max_store_bytes={limit}: {used} bytes in use, "
                               f"the snapshot needs {nbytes} more")

    def wait(self, timeout_s: float = 60.0) -> None:
        """Block until the snapshots handed over so far are published and replicated; raises
        StorageError naming the wait if that takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise StorageError(f"[rank {self.rank}] RAM snapshots still publishing or replicating after "
                                   f"{timeout_s:.0f} s (recovery.replication_timeout_s)")  # fmt: skip
            time.sleep(0.01)

    def _take_latched(self) -> str | None:
        if self._error is None:
            return None
        error, self._error = self._error, None
        return f"the previous snapshot failed: {type(error).__name__}: {error}"

    def _run(self) -> None:
        lower_thread_priority(self.config.background_nice)
        while (job := self._queue.get()) is not None:
            try:
                self._publish_and_replicate(job)
            except Exception as e:  # latched: the next snapshot() reports it (and is skipped)
                log.warning("[rank %d] RAM snapshot of step %d failed: %s", self.rank, job.index.step, e)
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _publish_and_replicate(self, job: _Job) -> None:
        index, data = job.index, job.data
        start = time.perf_counter()
        for entry in index.tensors:
            entry.crc32c = checksum(data, entry)
        self.own.publish(index)
        mark_store(self.root)
        record = {"event": "ram_snapshot", "group": self.group, "rank": self.rank, "step": index.step,
                  "bytes": index.nbytes, "copy_s": round(job.copy_s, 6),
                  "publish_s": round(time.perf_counter() - start, 6)}  # fmt: skip
        try:
            record["replication"] = self._replicate(index, data)
        finally:
            self.own.release(index.slot)
            self.stats.write(record)

    def _replicate(self, index: SnapshotIndex, data: torch.Tensor) -> dict[str, Any]:
        buddy = self.pairing.buddy_of(self.rank)
        if self._client is None:
            return {"outcome": "off" if buddy is not None else "no_buddy_node"}
        if not self._queue.empty():
            return {"outcome": "superseded", "buddy": buddy}  # a newer snapshot is waiting: send that one
        start = time.perf_counter()
        try:
            self._client.put(_key(self.rank, index.step), {"index": index.to_json()}, memoryview(data.numpy()))
        except ChannelError as e:
            # The snapshot stays valid locally; only the node-loss protection of this step is missing.
            log.warning("[rank %d] copy of step %d to buddy rank %d failed: %s", self.rank, index.step, buddy, e)
            return {"outcome": "failed", "buddy": buddy, "error": str(e)}
        seconds = time.perf_counter() - start
        return {"outcome": "copied", "buddy": buddy, "bytes": index.nbytes, "seconds": round(seconds, 6),
                "bytes_per_s": round(index.nbytes / max(seconds, 1e-9))}  # fmt: skip

    # -- restore -----------------------------------------------------------------------------

    def restore(self, state: dict[str, Any], persistent_step: int | None) -> RamRestore:
        """Collective: restore ``state`` in place from the newest step every rank has in RAM, if it
        is not older than ``persistent_step``. Returns what was decided (source None: not from RAM)."""
        start = time.perf_counter()
        leaves = flatten_state(state)
        excluded: list[dict[str, Any]] = []
        reports = rdist.all_gather_object(self._safe_report(leaves, excluded))
        ruled_out: set[int] = set()
        while True:
            step = self._choose(reports, ruled_out)
            if step is None or (persistent_step is not None and step < persistent_step):
                return RamRestore(None, None, excluded=excluded, seconds=time.perf_counter() - start)
            fetched = self._safe_fetch(step, reports, leaves, excluded)
            verdicts = rdist.all_gather_object(fetched is not None)
            if all(verdicts):
                assert fetched is not None
                source, index, data = fetched
                self._apply(index, data, leaves)
                self._forget_newer(step)
                return RamRestore(step, source, index.nbytes, time.perf_counter() - start, excluded)
            failed = [r for r, ok in enumerate(verdicts) if not ok]
            log.warning("[rank %d] RAM step %d unusable on rank(s) %s: excluded", self.rank, step, failed)
            ruled_out.add(step)

    def _safe_report(self, leaves: dict[str, Leaf], excluded: list[dict[str, Any]]) -> dict[str, Any]:
        # Whatever goes wrong reading this rank's store, it reports "nothing" and the group goes on:
        # a rank raising here would leave its peers waiting in the collective.
        try:
            return self._report(leaves, excluded)
        except Exception as e:
            excluded.append({"step": None, "source": "own", "reason": f"store unreadable: {type(e).__name__}: {e}"})
            return {"own": [], "kept": {}}

    def _safe_fetch(self, step: int, reports: list[dict[str, Any]], leaves: dict[str, Leaf],
                    excluded: list[dict[str, Any]]) -> tuple[str, SnapshotIndex, torch.Tensor] | None:  # fmt: skip
        try:
            return self._fetch(step, reports, leaves, excluded)
        except Exception as e:
            excluded.append({"step": step, "source": "own", "reason": f"{type(e).__name__}: {e}"})
            return None

    def _forget_newer(self, step: int) -> None:
        """Snapshots after the restored step belong to the abandoned timeline: hide them, so a later
        decision can never mix them with snapshots of the new one."""
        self.own.remove_newer(step)
        for rank in self.pairing.kept_by(self.rank):
            self.buddy_store(rank).remove_newer(step)

    def _report(self, leaves: dict[str, Leaf], excluded: list[dict[str, Any]]) -> dict[str, Any]:
        """The steps this rank can supply: its own compatible snapshots and the copies it keeps."""
        own = []
        indexes = self.own.indexes()
        excluded.extend({"step": None, "source": "own", "reason": r} for r in self.own.unreadable)
        for step, index in sorted(indexes.items()):
            reason = self._incompatible(index, leaves)
            if reason is None:
                own.append(step)
            else:
                excluded.append({"step": step, "source": "own", "reason": reason})
        kept = {r: sorted(self.buddy_store(r).indexes()) for r in self.pairing.kept_by(self.rank)}
        return {"own": own, "kept": kept}

    def _incompatible(self, index: SnapshotIndex, leaves: dict[str, Leaf]) -> str | None:
        if index.topology != self.topology:
            return f"taken on another topology {index.topology} (now {self.topology})"
        tensors = local_tensors(leaves)
        layout = {e.fqn: (e.dtype, e.shape) for e in index.tensors}
        current = {e.fqn: (e.dtype, e.shape) for e in layout_tensors(tensors)[0]}
        if layout != current:
            differ = sorted(set(layout.items()) ^ set(current.items()), key=str)[:3]
            return f"tensor layout differs from the training state (e.g. {differ})"
        if set(index.values) != {fqn for fqn, leaf in leaves.items() if not leaf.is_tensor}:
            return "JSON values differ from the training state"
        return None

    def _choose(self, reports: list[dict[str, Any]], ruled_out: set[int]) -> int | None:
        """The newest step every rank can get from its own store or its buddy's (same on every rank)."""
        common: set[int] | None = None
        for rank, report in enumerate(reports):
            available = set(report["own"])
            holder = self.pairing.buddy_of(rank)
            if holder is not None:
                available |= set(reports[holder]["kept"].get(rank, []))
            common = available if common is None else common & available
        candidates = (common or set()) - ruled_out
        return max(candidates) if candidates else None

    def _fetch(
        self, step: int, reports: list[dict[str, Any]], leaves: dict[str, Leaf], excluded: list[dict[str, Any]]
    ) -> tuple[str, SnapshotIndex, torch.Tensor] | None:
        """This rank's snapshot of ``step``, verified: own store first, else the buddy's copy."""
        if step in reports[self.rank]["own"]:
            own = self._own_verified(step)
            if isinstance(own, str):
                excluded.append({"step": step, "source": "own", "reason": own})
                log.warning("[rank %d] own RAM snapshot of step %d unusable: %s", self.rank, step, own)
            else:
                return own
        holder = self.pairing.buddy_of(self.rank)
        if holder is None or step not in reports[holder]["kept"].get(self.rank, []):
            return None
        return self._fetch_from_buddy(step, holder, leaves, excluded)

    def _own_verified(self, step: int) -> tuple[str, SnapshotIndex, torch.Tensor] | str:
        """This rank's own snapshot of ``step`` if it verifies, else why not."""
        try:
            index = self.own.indexes().get(step)
            if index is None:
                return "gone from the store"
            data = self.own.data(index)
            return first_corruption(index, data) or ("own", index, data)
        except Exception as e:  # a missing slot file, an I/O error: the buddy's copy may still do
            return f"{type(e).__name__}: {e}"

    def _fetch_from_buddy(
        self, step: int, holder: int, leaves: dict[str, Leaf], excluded: list[dict[str, Any]]
    ) -> tuple[str, SnapshotIndex, torch.Tensor] | None:
        try:
            with ReplicationClient(self._secret, tuple(self._addresses[holder]), rank=self.rank,
                                   timeout_s=self.config.replication_timeout_s) as client:  # fmt: skip
                reply = client.get(_key(self.rank, step))
        except ChannelError as e:
            excluded.append({"step": step, "source": "buddy", "reason": f"fetch from rank {holder} failed: {e}"})
            return None
        if reply is None:
            excluded.append({"step": step, "source": "buddy", "reason": f"rank {holder} no longer has it"})
            return None
        header, payload = reply
        index = SnapshotIndex.from_json(header["index"])
        # The client hands over the bytearray it received into: no further copy.
        data = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        reason = first_corruption(index, data) or self._incompatible(index, leaves)
        if reason is not None:
            excluded.append({"step": step, "source": "buddy", "reason": reason})
            return None
        return "buddy", index, data

    @torch.no_grad()
    def _apply(self, index: SnapshotIndex, data: torch.Tensor, leaves: dict[str, Leaf]) -> None:
        tensors = local_tensors(leaves)
        for entry in index.tensors:
            tensors[entry.fqn].copy_(tensor_view(data, entry))
        for fqn, value in index.values.items():
            set_leaf(leaves[fqn], value)
