"""The RAM tier: frequent snapshots in node memory, copied to a buddy node, restored without storage.

``snapshot(step, state)`` (training thread) copies this rank's local tensors into a reused slot of
its node store: one memcpy, the only part training waits for. A background thread then computes
the crc32c of every tensor, publishes the index (the snapshot becomes visible) and streams it to
the buddy rank over the replication channel (authenticated, never the training process group).
Only the newest snapshot is replicated: a snapshot whose copy has not started when the next one
arrives is not sent (recorded as "superseded").

``restore(state, persistent_step)`` is the collective RAM restore decision of
``resilient.recovery.ram.restore``; ``resilient.recovery.restore`` puts it in its place among the
tiers, and sets ``timeline`` (``recovery.timeline``): the run and timeline snapshots are tagged with,
and the only ones the decision may restore. ``start`` learns every rank's machine
(``ram.node_id``) and recomputes the nodes and buddies from them. The buddy side (what this rank
serves to and keeps for others) is ``ram.buddy``. Both it and the restore decision read the tier
through a ``RamView`` (``view()``), never the tier itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from resilient import dist as rdist
from resilient.errors import StorageError
from resilient.metrics import JsonlSink
from resilient.recovery.channel import (
    ChannelError,
    ReplicationClient,
    ReplicationServer,
    bind_host,
    lower_thread_priority,
    shared_secret,
)
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ownership import StoreInUse, StoreLock, hold_store, job_identity
from resilient.recovery.ram.buddy import BuddyHandler, snapshot_key
from resilient.recovery.ram.node_id import exchange as exchange_node_ids
from resilient.recovery.ram.node_id import resolve_node_id
from resilient.recovery.ram.pairing import Pairing
from resilient.recovery.ram.restore import RamRestore, restore_from_ram
from resilient.recovery.ram.store import (
    NodeStores,
    check_private_dir,
    clean_stale_stores,
    mark_store,
    node_store_dir,
    ranks_per_node,
    store_root,
)
from resilient.recovery.ram.view import RamView
from resilient.recovery.snapshot_format import (
    SnapshotIndex,
    checksum,
    json_values,
    layout_tensors,
    local_tensors,
    tensor_view,
)
from resilient.recovery.timeline import UNTRACKED, Timeline
from resilient.runfiles import TIMELINE_FILE, read_json, write_json
from resilient.state import flatten_state

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    index: SnapshotIndex
    data: torch.Tensor
    copy_s: float


class RamTier:
    """Node-local snapshots of one rank, replicated to its buddy; see the module docstring."""

    def __init__(
        self,
        config: RamTierConfig,
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
        self.run_dir, self.fingerprint = run_dir, fingerprint
        self.root = store_root(config, run_dir)
        self.stats = JsonlSink(stats_path)
        self._pruned = False
        # Simulated nodes until ``start`` learns every rank's machine (``_place``).
        self._place(Pairing(world_size, ranks_per_node(config, world_size), tuple(config.failure_domains)))
        self._lock: StoreLock | None = None
        self._server: ReplicationServer | None = None
        self._client: ReplicationClient | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._timeline: Timeline = UNTRACKED

    @property
    def timeline(self) -> Timeline:
        """Set by the restore policy before the decision (what may restore) and after it (what new
        snapshots are tagged with)."""
        return self._timeline

    @timeline.setter
    def timeline(self, value: Timeline) -> None:
        self._timeline = value
        if value.run_id and value.timeline:
            # Kept next to the data it governs, on every node: a restore needs neither the run
            # directory (lost with a pod) nor storage to know which snapshots may restore.
            with contextlib.suppress(OSError):
                write_json(os.path.join(self.node_dir, TIMELINE_FILE), value.to_json())

    def node_record(self) -> dict[str, Any] | None:
        """The timeline this node's store last recorded (``timeline``), for the restore policy."""
        return read_json(os.path.join(self.node_dir, TIMELINE_FILE))

    # -- lifecycle ---------------------------------------------------------------------------

    def _place(self, pairing: Pairing) -> None:
        """Put this rank on ``pairing``'s node: its store directory, node identity and topology."""
        self.pairing = pairing
        self.node = pairing.node_of(self.rank)
        self.local_rank = pairing.ranks_on(self.node).index(self.rank)
        named = bool(pairing.identities)
        self.node_id = pairing.identities[self.rank] if named else f"node{self.node}"
        self.node_dir = node_store_dir(self.config, self.run_dir, self.group, self.node_id if named else self.node)
        self.stores = NodeStores(self.node_dir, self.keep, self._current)
        self.own = self.stores.own(self.rank)
        self.topology = {
            "world_size": pairing.world_size,
            "ranks_per_node": pairing.ranks_per_node,
            "group": self.group,
            **self.fingerprint,
        }

    def _place_by_identity(self) -> None:
        """Collective: recompute the nodes from every rank's machine (``ram.node_id``), so a restart
        that renumbers ranks or nodes finds each store where it was. One machine (every identity
        the same) keeps the simulated nodes of ``recovery.ranks_per_node``."""
        identity, source = resolve_node_id()
        identities = exchange_node_ids(identity)
        if len(set(identities)) > 1:
            self._place(Pairing.from_identities(identities, tuple(self.config.failure_domains)))
            configured = self.config.ranks_per_node
            if configured and configured != self.pairing.ranks_per_node and self.rank == 0:
                log.warning(
                    "[rank 0] recovery.ranks_per_node=%d ignored: the ranks run on %d machines of %d ranks each",
                    configured,
                    self.pairing.nodes,
                    self.pairing.ranks_per_node,
                )
        log.info(
            "[rank %d] RAM tier node %s (from %s; node %d of %d, local rank %d)",
            self.rank,
            self.node_id,
            source,
            self.node,
            self.pairing.nodes,
            self.local_rank,
            extra={"event": "ram_node", "node_id": self.node_id, "node": self.node, "local_rank": self.local_rank},
        )

    def start(self) -> None:
        """Open the store and the replication channel (collective: exchanges the node identities
        and the channel addresses over the group's process group, once, before training; the
        channel key is derived on every rank from the job secret, never sent). A failure on one
        rank is raised on every rank, so no peer waits in a collective for it."""
        self._place_by_identity()
        self._secret = shared_secret(self.run_dir, self.group)
        try:
            self._addresses = rdist.agree(self._open)
        except Exception:
            if self._server is not None:
                self._server.close()
            if self._lock is not None:
                self._lock.close()
            raise
        buddy = self.pairing.buddy_of(self.rank)
        if buddy is not None and self.config.replication:
            self._client = ReplicationClient(
                self._secret,
                tuple(self._addresses[buddy]),
                rank=self.rank,
                timeout_s=self.config.replication_timeout_s,
                bytes_per_s=self.config.replication_bytes_per_s,
            )
        self._worker = threading.Thread(target=self._run, name="resilient-ram-tier", daemon=True)
        self._worker.start()

    def _open(self) -> list[Any]:
        """This rank's store and channel server; returns the server's address."""
        try:
            self._open_store()
            self._server = ReplicationServer(
                self._secret,
                BuddyHandler(self.view()),
                host=bind_host(self.config),
                timeout_s=self.config.replication_timeout_s,
                thread_nice=self.config.background_nice,
            )
            self._server.start()
        except StoreInUse:
            raise  # another run holds this store: its own line names it
        except Exception as e:
            hint = "set recovery.store_dir to a writable local directory, or checkpoint.memory_every=0"
            raise StorageError(
                f"cannot start the RAM tier under {self.node_dir}: {type(e).__name__}: {e} ({hint})"
            ) from e
        return list(self._server.address)

    def _open_store(self) -> None:
        check_private_dir(os.path.dirname(self.root))
        # Held for the tier's life: another job's ranks on this store are refused (``ownership``).
        self._lock = hold_store(self.root, job_identity(), self.run_dir)
        mark_store(self.root)
        if self.rank == 0:
            clean_stale_stores(os.path.dirname(self.root), self.root, self.config.stale_after_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the snapshot in flight (published and replicated), stop the channel; bounded."""
        if self._worker is not None:
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                log.warning(
                    "[rank %d] RAM tier worker busy for %.0f s at close: not waiting for it", self.rank, timeout_s
                )
            self._worker.join(timeout_s)
            if self._worker.is_alive():
                log.warning("[rank %d] RAM tier worker still running after %.0f s: abandoned", self.rank, timeout_s)
            self._worker = None
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _drop_abandoned_left_here(self) -> None:
        """Free the abandoned snapshots of the stores a renumbering left on this node: nothing
        publishes into them any more, so the eviction that follows a publish never visits them.
        Once per tier, after its first publish of the timeline the run's record names now."""
        current, view = self._current(), self.view()
        for rank in view.left_here():
            for store in view.copies_of(rank):
                store.drop_abandoned(current)

    def _current(self) -> Timeline:
        """What the stores evict against: this run's timeline now (a publish of another one is late)."""
        return self.timeline

    def connect_to(self, rank: int) -> ReplicationClient:
        """A new channel client to ``rank``'s server (the restore fetches its buddy copy with it)."""
        return ReplicationClient(
            self._secret, tuple(self._addresses[rank]), rank=self.rank, timeout_s=self.config.replication_timeout_s
        )

    def view(self) -> RamView:
        """What the restore decision and the buddy handler read of this tier (``ram.view``)."""
        return RamView(
            rank=self.rank,
            pairing=self.pairing,
            own=self.own,
            stores=self.stores,
            timeline=self.timeline,
            topology=self.topology,
            connect=self.connect_to,
        )

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
            self.stats.write(
                {
                    "event": "ram_snapshot",
                    "group": self.group,
                    "rank": self.rank,
                    "step": step,
                    "outcome": "skipped",
                    "reason": reason,
                }
            )
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
        index = SnapshotIndex(
            step=step,
            rank=self.rank,
            topology=self.topology,
            tensors=entries,
            values=json_values(leaves),
            slot=slot,
            nbytes=nbytes,
            run_id=self.timeline.run_id,
            timeline=self.timeline.timeline,
            node_id=self.node_id,
            local_rank=self.local_rank,
        )
        return _Job(index, data, time.perf_counter() - start)

    def _check_budget(self, nbytes: int) -> None:
        """``recovery.max_store_bytes``: slot files in use plus the new one must fit (spare slots
        are dropped first); otherwise the snapshot is skipped, never the store overrun."""
        limit = self.config.max_store_bytes
        if not limit:
            return
        stores = [self.own, *(self.stores.kept(r) for r in self.pairing.kept_by(self.rank))]
        if sum(s.bytes_used() for s in stores) + nbytes <= limit:
            return
        for store in stores:
            store.drop_spare_slots()
        used = sum(s.bytes_used() for s in stores)
        if used + nbytes > limit:
            raise StorageError(
                f"recovery.max_store_bytes={limit}: {used} bytes in use, the snapshot needs {nbytes} more"
            )

    def wait(self, timeout_s: float = 60.0) -> None:
        """Block until the snapshots handed over so far are published and replicated; raises
        StorageError naming the wait if that takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise StorageError(
                    f"[rank {self.rank}] RAM snapshots still publishing or replicating after "
                    f"{timeout_s:.0f} s (recovery.replication_timeout_s)"
                )
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
        current = self._current()
        if not self._pruned and (index.run_id, index.timeline) == (current.run_id, current.timeline):
            self._pruned = True
            self._drop_abandoned_left_here()
        record = {
            "event": "ram_snapshot",
            "group": self.group,
            "rank": self.rank,
            "step": index.step,
            "bytes": index.nbytes,
            "copy_s": round(job.copy_s, 6),
            "publish_s": round(time.perf_counter() - start, 6),
        }
        try:
            record["replication"] = self._replicate(index, data)
        finally:
            self.own.release(index.slot)
            self.stats.write(record)
        self._warm_slots(index.nbytes)

    def _warm_slots(self, nbytes: int) -> None:
        """Have every slot the store can need ready (``keep`` visible, one in replication, one for
        the next copy), made here rather than on the training thread; within the store budget."""
        limit, count = self.config.max_store_bytes, self.keep + 2
        if limit and self.own.bytes_used() + nbytes > limit:
            return
        try:
            self.own.warm(nbytes, count)
        except OSError as e:  # a full tmpfs: the copy that needs the slot reports it
            log.warning("[rank %d] cannot prepare RAM snapshot slots ahead: %s", self.rank, e)

    def _replicate(self, index: SnapshotIndex, data: torch.Tensor) -> dict[str, Any]:
        buddy = self.pairing.buddy_of(self.rank)
        if self._client is None:
            return {"outcome": "off" if buddy is not None else "no_buddy_node"}
        if not self._queue.empty():
            return {"outcome": "superseded", "buddy": buddy}  # a newer snapshot is waiting: send that one
        start = time.perf_counter()
        try:
            self._client.put(snapshot_key(self.rank, index.step), {"index": index.to_json()}, memoryview(data.numpy()))
        except ChannelError as e:
            # The snapshot stays valid locally; only the node-loss protection of this step is missing.
            log.warning("[rank %d] copy of step %d to buddy rank %d failed: %s", self.rank, index.step, buddy, e)
            return {"outcome": "failed", "buddy": buddy, "error": str(e)}
        seconds = time.perf_counter() - start
        return {
            "outcome": "copied",
            "buddy": buddy,
            "bytes": index.nbytes,
            "seconds": round(seconds, 6),
            "bytes_per_s": round(index.nbytes / max(seconds, 1e-9)),
        }

    # -- restore -----------------------------------------------------------------------------

    def restore(
        self, state: dict[str, Any], persistent_step: int | None, *, newest: int | None = None, in_place: bool = False
    ) -> RamRestore:
        """Collective: restore ``state`` in place from the newest step every rank has in RAM of the
        current ``timeline``, if it is not older than ``persistent_step`` (nor newer than ``newest``).
        Returns what was decided (source None: not from RAM). ``in_place``: snapshots may land in the
        state's tensors before every rank has its own; with source None and ``touched`` they are
        then undefined, and the caller must load a step, put the initial state back, or fail; see
        ``resilient.recovery.ram.restore``."""
        return restore_from_ram(self.view(), state, persistent_step, newest=newest, in_place=in_place)
