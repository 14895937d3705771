"""Stage 2 of a save (DESIGN §6), persist: write this rank's staged regions into zarr arrays (and,
on rank 0, the zarr.json documents), report a receipt, then hand over to stage 3 (``commit.py``).

A ``PersistJob`` is plain data (JSON-able), so the same ``run_persist`` runs on the writer thread
or in a writer process. Nothing here issues a collective: ranks coordinate through receipts and
the manifest in storage, so a slow or dead rank can never deadlock the training process group.

All opens are issued before any write and all writes before any wait, so TensorStore keeps the
whole save in flight at once (resolving futures one by one was many times slower here).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import crc32c
import numpy as np
import torch

from resilient.dtypes import to_numpy, torch_dtype
from resilient.errors import ResilientError, StorageError
from resilient.faults import fault_point
from resilient.layout import ArrayPlan, Box, Region, plan_from_json, plan_to_json
from resilient.manifest import FORMAT_VERSION, array_path, step_dir
from resilient.metrics import SaveStats
from resilient.storage.arrays import (
    kvstore_spec,
    open_array,
    plan_metadata,
    zarr_array_document,
    zarr_group_document,
)
from resilient.storage.checksum import crc32c_concat
from resilient.storage.commit import commit_step, settle_failure, wait_for_commit, write_receipt
from resilient.storage.localwrite import AttemptFiles, run_parallel
from resilient.storage.objects import ObjectStore
from resilient.storage.shardfile import chunk_key, encode_shard, shards_in
from resilient.storage.snapshot import StagedRegion
from resilient.storage.url import Location

SMALL_OBJECT_BYTES = 256 << 10
"""Shard objects of fewer bytes (and every zarr.json) are written in groups, each by one thread."""
SMALL_GROUP_BYTES = 64 << 20
"""The most bytes of small objects one thread writes in turn: past that, another group (and
thread) takes over, so many mid-size shards (a wide layer over hundreds of ranks) still spread."""


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
    deadline: float = 0.0
    """Unix time by which the step must be committed, the same instant on every rank (taken when
    the save's agreement returned); 0: ``commit_timeout_s`` from when the persist starts."""
    poll_cap_s: float | None = None
    """Longest sleep between storage polls (None: by scheme and world size, ``commit.poll_cap_s``)."""
    keep_last: int | None = None
    io_threads: int = 4

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
    """Persist this rank's part of ``job`` and see the step committed (or raise why not): the
    outcome is the coordinator's decision, the same on every rank (``commit.settle_failure``)."""
    if not job.deadline:
        job.deadline = time.time() + job.commit_timeout_s
    stats = SaveStats(step=job.step, rank=job.rank)
    stats.bytes_total = sum(p.nbytes for p in job.plans.values())
    t0 = time.perf_counter()
    try:
        items = _region_data(job, buffer)
        if location.scheme == "file":
            written = write_local(job, items, location.url)
        else:
            # zarr.json documents go out alongside the data, not before it.
            docs = (
                write_zarr_documents(location, job.attempt_key, job.plans, context, job.step) if job.rank == 0 else []
            )
            written = write_regions(location, job.attempt_key, items, context)
            for future in docs:
                future.result()
        stats.bytes_written = sum(r["nbytes"] for r in written)
        write_receipt(store, job.attempt_key, job.rank, {"rank": job.rank, "regions": written})
    except Exception as e:
        error = _as_resilient(e, job, location)
        if error is not e:
            error.__cause__ = e
        settle_failure(job, store, error)
        stats.persist_s = time.perf_counter() - t0
        return stats  # committed anyway: this rank's receipt landed although its write raised
    stats.persist_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    if job.rank == 0:
        try:
            commit_step(job, store)
        except Exception as e:
            raise _as_resilient(e, job, location) from e
    else:
        wait_for_commit(job, store)
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


@dataclass(slots=True)
class RegionData:
    """One region this rank writes, with its bytes already in host memory."""

    plan: ArrayPlan
    region: Region
    data: np.ndarray  # C-contiguous, shape == region.box.sizes


def write_regions(location: Location, attempt_key: str, items: list[RegionData], context) -> list[dict]:
    """Write every region; returns the receipt entries (fqn, box, bytes, crc32c of the raw bytes)."""
    opened = {}
    for item in items:
        fqn = item.plan.fqn
        if fqn not in opened:
            opened[fqn] = open_array(location, f"{attempt_key}/{array_path(fqn)}", plan_metadata(item.plan), context)
    pending = []
    receipt = []
    for i, item in enumerate(items):
        store = opened[item.plan.fqn].result()
        pending.append(store[item.region.box.slices()].write(item.data))
        receipt.append(_receipt_entry(item))
        if i == 0:
            fault_point("persist.first_region_issued")
    for future in pending:
        future.result()
    fault_point("persist.regions_written")
    return receipt


def write_local(job: PersistJob, items: list[RegionData], root: str) -> list[dict]:
    """The file system path of ``write_regions``: every shard object (and on rank 0 every zarr.json)
    written by ``job.io_threads`` threads straight from the staging buffer, then made durable in
    one pass (``localwrite``) before the receipt can be written."""
    objects = (
        [(f"{job.attempt_key}/{key}", doc) for key, doc in zarr_documents(job.plans, job.step).items()]
        if job.rank == 0
        else []
    )
    # per region, each shard's (crc32c, nbytes) of its chunks, filled by the shard's writer; None
    # where the region's crc32c cannot be made from its chunks' and is computed from its bytes
    shards = [_shards(item) for item in items]
    piece_crcs = [
        [[] for _ in boxes] if _crc_from_chunks(item) else [None] * len(boxes)
        for item, boxes in zip(items, shards, strict=True)
    ]
    objects += [
        (f"{job.attempt_key}/{array_path(item.plan.fqn)}/{key}", (item, box, crcs))
        for item, boxes, shard_crcs in zip(items, shards, piece_crcs, strict=True)
        for (key, box), crcs in zip(boxes, shard_crcs, strict=True)
    ]
    files = AttemptFiles(root, expected_files=len(objects))
    if objects:  # a rank with nothing to write (all its tensors written by a peer) makes nothing durable;
        # it must not fsync step-N/ either: the rank that creates it may not have yet (ENOENT)
        files.sync_dirs_anyway(["", step_dir(job.step)])  # the root names step-N/, step-N/ the attempt
    first_shard = threading.Lock()  # held once the first shard is written (whichever thread wrote it)

    def write(key: str, what) -> None:
        files.make_parent(key)
        if isinstance(what, dict):
            files.write(key, [json.dumps(what).encode()])
            return
        item, box, crcs = what
        files.write(key, encode_shard(_within(item, box), item.plan.shard_shape, item.plan.inner_shape, crcs))
        if first_shard.acquire(blocking=False):
            fault_point("persist.first_region_issued")

    try:
        run_parallel(_writer_tasks(objects, write), job.io_threads)
        fault_point("persist.regions_written")
        files.make_durable(job.io_threads)
    finally:
        files.close()
    return [_receipt_entry(item, _region_crc(item, crcs)) for item, crcs in zip(items, piece_crcs, strict=True)]


def _crc_from_chunks(item: RegionData) -> bool:
    """Whether the region's bytes are its inner chunks' in-bounds bytes one after another: true
    when shards and inner chunks span the region in every dimension but the first (row bands)."""
    dims = zip(item.plan.shard_shape[1:], item.plan.inner_shape[1:], item.region.box.sizes[1:], strict=True)
    return all(shard == inner == size for shard, inner, size in dims)


def _region_crc(item: RegionData, shard_crcs: list) -> int | None:
    """The region's crc32c from its shards' chunk crcs (in shard order), None if not made that way."""
    if not shard_crcs or shard_crcs[0] is None:
        return None
    pieces = [piece for crcs in shard_crcs for piece in crcs]
    if sum(nbytes for _, nbytes in pieces) != item.data.nbytes:
        return None  # the chunks are not the region's bytes after all: read them (never expected)
    return crc32c_concat(pieces)


def _writer_tasks(objects: list[tuple[str, object]], write: Callable[[str, object], None]) -> list[Callable[[], None]]:
    """Small objects in groups of up to ``SMALL_GROUP_BYTES``, each group written in turn by one
    thread and drawn first (shards before zarr.json documents, so the first shard goes out early),
    then one task per big object. Creating many small files is kernel metadata work that more
    threads only contend for (2,000 tensors of 16 KiB here: 0.55-0.65 s by one thread, 0.72-0.88 s
    by four), while page-cache copies of many bytes do run side by side."""
    sized = [(key, what, _object_bytes(what)) for key, what in objects]
    small = [entry for entry in sized if not isinstance(entry[1], dict) and entry[2] < SMALL_OBJECT_BYTES]
    docs = [entry for entry in sized if isinstance(entry[1], dict)]
    big = [(key, what) for key, what, nbytes in sized if not isinstance(what, dict) and nbytes >= SMALL_OBJECT_BYTES]
    groups = _groups(small + docs, SMALL_GROUP_BYTES)
    tasks: list[Callable[[], None]] = [lambda g=group: [write(key, what) for key, what in g] for group in groups]
    return tasks + [lambda k=key, w=what: write(k, w) for key, what in big]


def _groups(objects: list[tuple[str, object, int]], cap: int) -> list[list[tuple[str, object]]]:
    """(key, object, bytes) cut, in order, into runs of at most ``cap`` bytes (at least one object each)."""
    groups: list[list[tuple[str, object]]] = []
    total = 0
    for key, what, nbytes in objects:
        if not groups or total + nbytes > cap:
            groups.append([])
            total = 0
        groups[-1].append((key, what))
        total += nbytes
    return groups


def _object_bytes(what) -> int:
    """The size of a shard object's data (a zarr.json document counts as small)."""
    if isinstance(what, dict):
        return 0
    item, box, _crcs = what
    return math.prod(box.sizes) * item.data.itemsize


def _shards(item: RegionData) -> list[tuple[str, Box]]:
    return [
        (chunk_key(index, format_version=FORMAT_VERSION), box)
        for index, box in shards_in(item.region.box, item.plan.shard_shape)
    ]


def _within(item: RegionData, box: Box) -> np.ndarray:
    """The part of the region's data that is the shard at ``box``."""
    origin = item.region.box.offsets
    return item.data[tuple(slice(o - r, o - r + n) for o, r, n in zip(box.offsets, origin, box.sizes, strict=True))]


def _receipt_entry(item: RegionData, crc: int | None = None) -> dict:
    """What the receipt says of a region; ``crc`` is its crc32c when already known."""
    return {
        "fqn": item.plan.fqn,
        **item.region.box.to_json(),
        "nbytes": int(item.data.nbytes),
        "crc32c": crc32c.crc32c(item.data.reshape(-1).view(np.uint8)) if crc is None else crc,
    }


def zarr_documents(plans: dict[str, ArrayPlan], step: int) -> dict[str, dict]:
    """``zarr.json`` of the attempt group, every intermediate group and every array, by key under
    the attempt (so ``zarr.open_group(<step>/<attempt>)`` works with plain zarr-python)."""
    docs: dict[str, dict] = {"zarr.json": zarr_group_document({"resilient_step": step})}
    for fqn, plan in plans.items():
        parts = array_path(fqn).split("/")
        for depth in range(1, len(parts)):
            docs.setdefault("/".join(parts[:depth]) + "/zarr.json", zarr_group_document())
        docs["/".join(parts) + "/zarr.json"] = zarr_array_document(plan_metadata(plan), {"fqn": fqn})
    return docs


def write_zarr_documents(location: Location, attempt_key: str, plans: dict[str, ArrayPlan], context, step: int) -> list:
    """Start writing ``zarr.json`` for the attempt group, every intermediate group and every array
    (so ``zarr.open_group(<step>/<attempt>)`` works with plain zarr-python); returns the futures."""
    import tensorstore as ts

    kv = ts.KvStore.open(kvstore_spec(location, attempt_key), context=context).result()
    return [kv.write(key, json.dumps(doc).encode()) for key, doc in zarr_documents(plans, step).items()]
