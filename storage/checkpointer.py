"""``Checkpointer``: collective save/load of a nested state into Zarr v3 arrays (DESIGN §4-§6).

save: make room (the ``max_inflight`` policy) -> decide (``planner``: one all-gather of what every
rank holds, the same plan on every rank) -> stage (copy this rank's part) -> submit (the writer
persists it into this rank's packs and a receipt; rank 0 checks coverage and commits the manifest).
load: rank 0 picks the step and broadcasts its manifest -> each rank reads the boxes its tensors
need, on any mesh and world size.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch

from resilient import dist
from resilient.errors import CommitError, ConfigError, RestoreError
from resilient.layout import LocalTensor, describe_local
from resilient.manifest import (
    MANIFEST,
    Manifest,
    step_dir,
)
from resilient.metrics import JsonlSink, RestoreStats, SaveStats
from resilient.state import flatten_state
from resilient.storage.arrays import make_context
from resilient.storage.commit import decision_grace_s, settle_failure
from resilient.storage.config import CheckpointerConfig
from resilient.storage.gcpause import gc_paused
from resilient.storage.handle import SaveHandle
from resilient.storage.match import match_state
from resilient.storage.objects import open_store
from resilient.storage.outcomes import SaveLedger, SaveOutcomes
from resilient.storage.persist import PersistJob
from resilient.storage.planner import SaveDecision, SavePlanner
from resilient.storage.reader import ReadTarget, read_into
from resilient.storage.retention import list_steps
from resilient.storage.snapshot import Snapshot, SnapshotLayout, StagingPool, take_snapshot
from resilient.storage.url import parse_url
from resilient.storage.workers import PersistProcess, PersistThread, start_background

log = logging.getLogger(__name__)
_DELIVERY_SLACK_S = 5.0  # from the coordinator's decision to this rank's writer reporting it


class Checkpointer:
    """Save and load nested state dicts of tensors, DTensors and JSON values. Collective: call
    ``save``/``load`` on every rank of ``process_group`` (or in one process with none)."""

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = None,
        process_group: Any = None,
        storage_options: dict | None = None,
        config: CheckpointerConfig | None = None,
    ) -> None:
        if config is None:
            config = CheckpointerConfig(keep_last=keep_last)
        elif keep_last is not None:
            raise ConfigError("pass keep_last either directly or in config, not both")
        self.config = config
        self.location = parse_url(url, storage_options)
        self.url = self.location.url
        self.store = open_store(self.location)
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._context = make_context(self.location)
        self._ledger = SaveLedger(rank=self.rank, sink=JsonlSink(config.metrics_path))
        self.save_stats = self._ledger.stats
        self._inflight: list[SaveHandle] = []  # saves whose persist may still be running
        self._outcomes = SaveOutcomes()  # saves whose error (if any) is not raised yet
        self._pool = StagingPool(
            budget_bytes=config.staging_bytes,
            pin_memory=torch.cuda.is_available(),
            shared_memory=config.writer == "process",
        )
        self._ledger.pool = self._pool
        self._writer = None
        self._stream = None
        self._planner = SavePlanner(
            group=process_group,
            rank=self.rank,
            world_size=self.world_size,
            store=self.store,
            config=config,
            outcomes=self._outcomes,
        )
        self.restore_stats: list[RestoreStats] = []
        self.storage_reads = 0
        """Objects this Checkpointer asked storage for in loads (manifest + one per region read):
        lets a caller prove that a restore from another tier read nothing from storage."""

    # -- public API --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        self.store.check_root(create=False)
        return list_steps(self.store).committed

    def save(self, step: int, state: dict, *, metadata: dict | None = None) -> SaveHandle:
        """Snapshot ``state`` as ``step`` and persist it in the background. Returns once the state
        is staged (CPU: copied; CUDA: copies enqueued, see ``handle.wait_staged``); ``handle.wait()``
        returns when the step is committed and raises if the save failed. Every error is raised on
        every rank at the same call: here, or (if it happens after the ranks agreed to save) as
        this save's outcome, at the next ``save``/``wait``."""
        start = time.perf_counter()
        stats = SaveStats(step=step, rank=self.rank)
        busy, late = self._make_room(stats)
        decision = self._planner.decide(
            step, state, metadata, busy=busy, late=late, copy_early=self._snapshot, discard=self._discard
        )
        # The commit clock starts here, at one instant on every rank (the agreement just returned):
        # no rank can give up on the step while another still commits it.
        deadline = time.time() + self.config.commit_timeout_s
        if decision.attempt is None:  # some rank was busy under if_busy="skip": every rank skips together
            stats.outcome = stats.policy = "skipped"
            self._ledger.record(stats)
            return SaveHandle.skipped(stats)
        job = self._job(decision, metadata, deadline)
        handle = SaveHandle(step, decided_by=deadline + self._grace_s())
        handle.stats, handle.attempt = stats, decision.attempt
        self._inflight.append(handle)
        self._outcomes.track(handle)
        snap = None
        try:
            snap = self._stage(decision)
            stats.snapshot_s = time.perf_counter() - start
            job.regions = snap.regions
            handle.set_staged(snap.staged)
            self._writer_for().submit(job, snap.buffer, snap.staged, handle)
        except Exception as e:  # after the agreement: not raised here alone, it is this save's outcome
            self._fail_in_background(job, handle, snap, e)
        return handle

    def _job(self, decision: SaveDecision, metadata: dict | None, deadline: float) -> PersistJob:
        """What the writer persists for this decision (its regions are set once staged)."""
        return PersistJob(
            step=decision.step,
            attempt=decision.attempt,
            rank=self.rank,
            world_size=self.world_size,
            plans=decision.plans,
            regions=[],
            values=decision.values,
            metadata=metadata or {},
            commit_timeout_s=self.config.commit_timeout_s,
            deadline=deadline,
            poll_cap_s=self.config.poll_cap_s,
            keep_last=self.config.keep_last or None,  # 0 keeps every step
            io_threads=self.config.io_threads,
        )

    def _stage(self, decision: SaveDecision) -> Snapshot:
        """This rank's part, copied into staging: the early copy when the plan it used still holds."""
        early = decision.early
        if early is not None and early[0] is decision.layout:
            return early[1]
        self._discard(early)  # no early copy, or a peer's layout changed and with it the plan
        return self._snapshot(decision.layout, decision.locals)

    def load(self, state: dict, step: int | None = None, *, strict: bool = True) -> int:
        """Load the newest committed step (or ``step``) into ``state`` in place; returns the step.
        Collective: every rank returns, or every rank raises the same error (a rank whose read
        failed alone would leave its peers waiting in their next collective)."""
        start = time.perf_counter()
        chosen, manifest = self._agree_on_manifest(step)
        got = dist.agree(lambda: self._load_local(state, chosen, manifest, strict), group=self.group)
        nbytes, reads, fetched = got[self.rank]
        self.storage_reads += reads
        stats = RestoreStats(
            step=chosen,
            rank=self.rank,
            bytes_read=nbytes,
            seconds=time.perf_counter() - start,
            storage_reads=reads,
            bytes_fetched=fetched,
        )
        self.restore_stats.append(stats)
        log.info(
            "[rank %d] restored step %d from %s (%d bytes)",
            self.rank,
            chosen,
            self.url,
            nbytes,
            extra={"event": "restore", "step": chosen, "source": "persistent"},
        )
        return chosen

    def _load_local(self, state: dict, chosen: int, manifest: Manifest, strict: bool) -> list[int]:
        """This rank's part of ``load``: its boxes read into ``state``; [bytes, objects read, bytes fetched]."""
        with gc_paused():  # a plan per tensor read, thousands of small objects (gcpause.py)
            return self._read_state(state, chosen, manifest, strict)

    def _read_state(self, state: dict, chosen: int, manifest: Manifest, strict: bool) -> list[int]:
        leaves = flatten_state(state)
        match = match_state(manifest, leaves, url=self.url, strict=strict)
        targets = []
        for fqn, leaf in match.tensors.items():
            local = describe_local(fqn, leaf.value)
            if local.box is not None:
                targets.append(ReadTarget(manifest.arrays[fqn], local.box, local.data))
        attempt_key = f"{step_dir(chosen)}/{manifest.attempt}"
        totals = read_into(
            self.location,
            attempt_key,
            targets,
            self._context,
            step=chosen,
            budget_bytes=self.config.load_budget_bytes,
        )
        match.apply_values(manifest, self.rank)
        return [totals.needed, 1 + len(targets), totals.fetched]

    def wait(self) -> None:
        """Block until every save in flight is decided; raise the first error not yet raised.
        Collective, like ``save``: every rank raises the same error here, or none does."""
        self._outcomes.agree(self.group, self.rank, late=self._drain())

    def close(self) -> None:
        """Flush saves in flight (they commit), stop the writer; raise this rank's background error
        not yet raised. Not collective (it also runs on failure paths, where peers may be gone):
        call ``wait()`` on every rank first for the agreed outcome."""
        try:
            late = self._drain()
            error = late if late is not None else self._outcomes.pop_first_error()[1]
            if error is not None:
                raise error
        finally:
            if self._writer is not None:
                self._writer.close(self.config.close_timeout_s)
                self._writer = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- save stages -------------------------------------------------------------------------

    def _drain(self) -> CommitError | None:
        """Wait until every save in flight is decided (close_timeout_s, and never less than until
        its decision is due); the timeout as an error to share, not raised here (a rank raising
        alone would strand its peers)."""
        floor = time.time() + self.config.close_timeout_s
        for handle in list(self._inflight):
            if not self._wait_decided(handle, floor):
                return CommitError(
                    f"save of step {handle.step} not decided within {self.config.close_timeout_s:.0f} s "
                    "(checkpoint.close_timeout_s) nor by its decision time; storage may hang: check it, or raise "
                    "checkpoint.close_timeout_s"
                )
        self._inflight = []
        return None

    def _grace_s(self) -> float:
        return decision_grace_s(self.config.commit_timeout_s, self.location.scheme)

    @staticmethod
    def _wait_decided(handle: SaveHandle, floor: float) -> bool:
        """Wait for ``handle`` until ``floor`` (unix time) or until its decision is due, whichever
        is later: giving up before the decision (a save started just before close) would raise
        "not decided" on this rank for a step its peers see committed."""
        until = max(floor, handle.decided_by + _DELIVERY_SLACK_S)
        return handle.wait_done(max(0.0, until - time.time()))

    def _make_room(self, stats: SaveStats) -> tuple[bool, CommitError | None]:
        """Apply the max_inflight policy locally: whether this rank is still busy ("skip"), and a
        wait that timed out, as an error for the agreement to raise on every rank."""
        self._inflight = [h for h in self._inflight if not h.done()]
        if len(self._inflight) < self.config.max_inflight:
            return False, None
        if self.config.if_busy == "skip":
            return True, None
        t0 = time.perf_counter()
        oldest = self._inflight.pop(0)
        # Every save is decided by its deadline plus the grace (commit.py); rank 0's handle completes
        # only after retention, so the wait is never shorter than a whole save's bound from now.
        if not self._wait_decided(oldest, time.time() + self.config.commit_timeout_s + self._grace_s()):
            return False, CommitError(f"save of step {oldest.step} still persisting after its decision was due")
        stats.waited_s = time.perf_counter() - t0
        stats.policy = "waited"
        return False, None

    def _fail_in_background(self, job: PersistJob, handle: SaveHandle, snap: Snapshot | None, error: Exception) -> None:
        """A rank that cannot stage or hand over its part after the ranks agreed to save: the
        coordinator decides the outcome as for a failed write (this rank's marker makes that
        prompt), on a thread, and the error is raised everywhere at the next save or wait."""
        buffer = snap.buffer if snap is not None else None

        def settle() -> None:
            try:
                settle_failure(job, self.store, error)
            except BaseException as e:  # latched on the handle, raised at the next collective call
                self._ledger.on_done(handle, buffer, None, e)
            else:
                self._ledger.on_done(handle, buffer, SaveStats(step=job.step, rank=job.rank), None)

        start_background(settle, "resilient-ckpt-settle")  # joined at exit, like the writers

    def _snapshot(self, layout: SnapshotLayout, locals_: dict[str, LocalTensor]) -> Snapshot:
        stream = self._side_stream(locals_)
        return take_snapshot(layout, locals_, self._pool, timeout_s=self.config.commit_timeout_s, stream=stream)

    def _discard(self, early: tuple[SnapshotLayout, Snapshot] | None) -> None:
        if early is None:
            return
        snap = early[1]
        if snap.staged is not None:
            snap.staged.synchronize()  # the copy must not land in a buffer handed to the next save
        self._pool.release(snap.buffer)

    def _side_stream(self, locals_: dict[str, LocalTensor]):
        if not any(t.data.is_cuda for t in locals_.values()):
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _writer_for(self):
        if self._writer is not None and not self._writer.alive():
            # Its saves fail through the agreed path (workers.py); the next one needs a writer.
            log.warning("[rank %d] the checkpoint writer is gone; starting a new one", self.rank)
            self._writer.stop_soon()
            self._writer = None
        if self._writer is None:
            if self.config.writer == "process":
                self._writer = PersistProcess(
                    self.location, self.store, self._ledger.on_done, nice=self.config.writer_nice
                )
            else:
                self._writer = PersistThread(
                    self.location, self.store, self._context, self._ledger.on_done, nice=self.config.writer_nice
                )
            # A Checkpointer dropped without close() must not leave its writer (and the staging
            # memory it holds) behind: the writer knows only the ledger, never the Checkpointer.
            weakref.finalize(self, self._writer.stop_soon)
        return self._writer

    # -- load --------------------------------------------------------------------------------

    def _agree_on_manifest(self, step: int | None) -> tuple[int, Manifest]:
        """Rank 0 picks the step and reads its manifest; every rank gets the same one (or the same error)."""

        held: dict[str, bytes] = {}

        def read() -> dict:
            chosen = self._resolve_step(step)
            data = self.store.read(f"{step_dir(chosen)}/{MANIFEST}")
            if data is None:
                raise RestoreError(f"step {chosen} vanished from {self.url} while loading; retry")
            held["data"] = data  # rank 0 parses the bytes it read; only its peers need them shipped
            return {"step": chosen, "manifest": data.decode() if self.world_size > 1 else None}

        got = dist.agree(read, group=self.group, src=0)
        where = f"{self.url}/{step_dir(got['step'])}/{MANIFEST}"
        with gc_paused():  # a manifest of thousands of arrays (gcpause.py)
            data = held["data"] if "data" in held else got["manifest"].encode()  # b"" is a damaged manifest
            return got["step"], Manifest.loads(data, where=where)

    def _resolve_step(self, step: int | None) -> int:
        self.store.check_root(create=False)
        listing = list_steps(self.store)
        if step is None:
            if not listing.committed:
                hint = f" ({len(listing.uncommitted)} uncommitted attempt(s) found)" if listing.uncommitted else ""
                raise RestoreError(f"no committed checkpoint under {self.url}{hint}; nothing to load")
            return listing.committed[-1]
        if step not in listing.committed:
            raise RestoreError(
                f"step {step} is not committed under {self.url}; committed steps: {listing.committed[-10:] or 'none'}"
            )
        return step
