"""One save's background work: write the staged regions, report a receipt, commit (rank 0).

A ``PersistJob`` is plain data (JSON-able), so the same ``run_persist`` runs on the writer thread
or in a writer process. Nothing here issues a collective: ranks coordinate through receipts and
the manifest in storage, so a slow or dead rank can never deadlock the training process group.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from resilient.dtypes import to_numpy, torch_dtype
from resilient.errors import CommitError, ResilientError, StorageError
from resilient.faults import fault_point
from resilient.layout import ArrayPlan, Box, Region, plan_from_json, plan_to_json
from resilient.manifest import MANIFEST, ArrayEntry, Manifest, array_path, encode_values, library_versions, step_dir
from resilient.metrics import SaveStats
from resilient.storage.commit import (
    FAILURES,
    check_coverage,
    commit_manifest,
    failure_key,
    wait_for_receipts,
    write_failure,
    write_receipt,
)
from resilient.storage.objects import ObjectStore
from resilient.storage.retention import KeepLast, apply_retention
from resilient.storage.url import Location
from resilient.storage.writer import RegionData, write_regions, write_zarr_documents

log = logging.getLogger(__name__)
COMMIT_RANK = -1  # failure marker name used by the coordinator when the commit itself fails


@dataclass(slots=True)
class StagedRegion:
    """A region of this rank's snapshot: where its bytes sit in the staging buffer."""

    fqn: str
    box: Box
    offset: int
    nbytes: int


@dataclass(slots=True)
class PersistJob:
    step: int
    attempt: str
    rank: int
    world_size: int
    plans: dict[str, ArrayPlan]
    regions: list[StagedRegion]
    values: list[dict] = field(default_factory=list)  # rank 0: every rank's JSON leaves
    metadata: dict = field(default_factory=dict)
    commit_timeout_s: float = 600.0
    keep_last: int | None = None

    @property
    def attempt_key(self) -> str:
        return f"{step_dir(self.step)}/{self.attempt}"

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["plans"] = [plan_to_json(p) for p in self.plans.values()]
        d["regions"] = [{**asdict(r), "box": r.box.to_json()} for r in self.regions]
        return d

    @staticmethod
    def from_json(d: dict) -> PersistJob:
        d = dict(d)
        d["plans"] = {p["fqn"]: plan_from_json(p) for p in d["plans"]}
        d["regions"] = [StagedRegion(**{**r, "box": Box.from_json(r["box"])}) for r in d["regions"]]
        return PersistJob(**d)


def run_persist(job: PersistJob, buffer: torch.Tensor, location: Location, store: ObjectStore, context) -> SaveStats:
    """Persist this rank's part of ``job`` and see the step committed (or raise why not)."""
    stats = SaveStats(step=job.step, rank=job.rank)
    stats.bytes_total = sum(p.nbytes for p in job.plans.values())
    t0 = time.perf_counter()
    try:
        # zarr.json documents go out alongside the data, not before it.
        docs = write_zarr_documents(location, job.attempt_key, job.plans, context, job.step) if job.rank == 0 else []
        written = write_regions(location, job.attempt_key, _region_data(job, buffer), context)
        for future in docs:
            future.result()
        stats.bytes_written = sum(r["nbytes"] for r in written)
        write_receipt(store, job.attempt_key, job.rank, {"rank": job.rank, "regions": written})
    except Exception as e:
        write_failure(store, job.attempt_key, job.rank, e)
        raise _as_resilient(e, job, location) from e
    stats.persist_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    if job.rank == 0:
        try:
            _commit(job, store)
        except Exception as e:
            write_failure(store, job.attempt_key, COMMIT_RANK, e)
            raise _as_resilient(e, job, location) from e
    else:
        _wait_for_commit(job, store)
    stats.commit_s = time.perf_counter() - t1
    return stats


def _as_resilient(err: Exception, job: PersistJob, location: Location) -> ResilientError:
    if isinstance(err, ResilientError):
        return err
    return StorageError(f"saving step {job.step} to {location.url} failed on rank {job.rank}: {err!r}")


def _region_data(job: PersistJob, buffer: torch.Tensor) -> list[RegionData]:
    items = []
    for r in job.regions:
        plan = job.plans[r.fqn]
        view = buffer[r.offset : r.offset + r.nbytes].view(torch_dtype(plan.dtype)).view(r.box.sizes)
        items.append(RegionData(plan, Region(r.box, job.rank), to_numpy(view)))
    return items


def _commit(job: PersistJob, store: ObjectStore) -> None:
    receipts = wait_for_receipts(store, job.attempt_key, job.world_size, timeout_s=job.commit_timeout_s, step=job.step)
    check_coverage(job.plans, receipts, job.step)
    fault_point("commit.before_manifest")
    crcs = {(r["fqn"], tuple(r["offsets"])): r["crc32c"] for rec in receipts for r in rec["regions"]}
    arrays = {fqn: manifest_entry(p, crcs) for fqn, p in job.plans.items()}
    manifest = Manifest(
        step=job.step, attempt=job.attempt, world_size=job.world_size, arrays=arrays,
        values=encode_values(job.values), metadata=job.metadata, versions=library_versions(),
    )
    commit_manifest(store, manifest)
    log.info("[rank 0] committed step %d to %s (%d arrays, %.1f MiB)", job.step, store.location.url,
             len(arrays), manifest.total_bytes / 2**20, extra={"event": "commit", "step": job.step})
    try:
        apply_retention(store, KeepLast(job.keep_last))
    except ResilientError as e:  # the step is committed; a failed cleanup is retried after the next commit
        log.warning("[rank 0] retention after step %d failed: %s", job.step, e)


def manifest_entry(p: ArrayPlan, crcs: dict) -> ArrayEntry:
    """The manifest entry of a planned array, with each region's crc32c (keyed by (fqn, offsets))."""
    return ArrayEntry(
        fqn=p.fqn, path=array_path(p.fqn), shape=list(p.shape), dtype=p.dtype, shard_shape=list(p.shard_shape),
        inner_shape=list(p.inner_shape), nbytes=p.nbytes, placements=list(p.placements),
        mesh_shape=list(p.mesh_shape), mesh_dim_names=list(p.mesh_dim_names),
        regions=[{**r.box.to_json(), "writer": r.writer, "crc32c": crcs[(p.fqn, r.box.offsets)]} for r in p.regions],
    )


def _wait_for_commit(job: PersistJob, store: ObjectStore) -> None:
    """Non-coordinators: the save counts as done once the manifest names this attempt."""
    key = f"{step_dir(job.step)}/{MANIFEST}"
    deadline = time.monotonic() + job.commit_timeout_s
    delay, polls = 0.002, 0
    while True:
        polls += 1
        data = store.read(key)
        if data is not None:
            if json.loads(data).get("attempt") != job.attempt:
                raise CommitError(f"step {job.step} was committed by another attempt; this save was discarded")
            return
        # A listing costs more than a read: look for failure markers on every 8th poll only.
        failures = store.list_children(f"{job.attempt_key}/{FAILURES}") if polls % 8 == 0 else []
        if failures:
            first = json.loads(store.read(f"{job.attempt_key}/{FAILURES}/{failures[0]}") or b"{}")
            who = "the commit" if first.get("rank") == COMMIT_RANK else f"rank {first.get('rank')}"
            raise CommitError(f"step {job.step} not committed: {who} failed: {first.get('error')}")
        if time.monotonic() > deadline:
            raise CommitError(
                f"step {job.step} not committed within {job.commit_timeout_s:.0f} s (rank 0 never wrote "
                f"{store.location.url}/{key}); the previous step is intact"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


__all__ = ["COMMIT_RANK", "PersistJob", "manifest_entry", "StagedRegion", "failure_key", "run_persist"]
