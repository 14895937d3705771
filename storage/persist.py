"""Stage 2 of a save (DESIGN §6), persist: encode this rank's staged regions as zarr shard objects,
write them into this rank's pack objects (``pack.py``: format version 3; rank 0's first pack also
holds every zarr.json), report a receipt naming where each shard lies, then hand over to stage 3
(``commit.py``).

A ``PersistJob`` is plain data (JSON-able), so the same ``run_persist`` runs on the writer thread
or in a writer process. Nothing here issues a collective: ranks coordinate through receipts and
the manifest in storage, so a slow or dead rank can never deadlock the training process group.

A rank writes one pack (more past ``pack.PACK_MAX_BYTES``) whatever its tensor count: a local pack
by ``io_threads`` threads at their offsets, made durable before the receipt (``localwrite``); on
S3 a single PUT, or a multipart upload of parts in parallel for a large one (``packio``).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass, field

import crc32c
import numpy as np
import torch

from resilient.dtypes import to_numpy, torch_dtype
from resilient.errors import ResilientError, StorageError
from resilient.layout import ArrayPlan, Box, Region, plan_from_json, plan_to_json
from resilient.manifest import FORMAT_VERSION, array_path, step_dir
from resilient.metrics import SaveStats
from resilient.storage.arrays import (
    plan_metadata,
    zarr_array_document,
    zarr_group_document,
)
from resilient.storage.checksum import crc32c_concat
from resilient.storage.commit import (
    commit_step,
    settle_failure,
    wait_for_commit,
    write_receipt,
)
from resilient.storage.gcpause import gc_paused
from resilient.storage.objects import ObjectStore
from resilient.storage.pack import PackBuilder, pack_name
from resilient.storage.packio import write_packs
from resilient.storage.parallel import run_parallel
from resilient.storage.shardfile import chunk_key, encode_shard, shards_in
from resilient.storage.snapshot import StagedRegion
from resilient.storage.url import Location

ENCODE_TASK_BYTES = 16 << 20
"""Regions encoded by one task of ``io_threads`` (big ones alone, small ones together)."""


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
        regions = write_rank(job, _region_data(job, buffer), location, store)
        receipt = {"rank": job.rank, "regions": regions}
        stats.bytes_written = sum(r["nbytes"] for r in receipt["regions"])
        if job.rank != 0:  # the coordinator is rank 0: its own receipt goes to the commit in memory
            write_receipt(store, job.attempt_key, job.rank, receipt)
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
            commit_step(job, store, own=receipt)
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
    """Each staged region as a numpy view of the staging buffer (numpy slices of one array: a
    torch view per region cost more than encoding a small tensor)."""
    flat = buffer.numpy()
    items = []
    for r in job.regions:
        plan = job.plans[r.fqn]
        data = flat[r.offset : r.offset + r.nbytes].view(numpy_dtype(plan.dtype)).reshape(r.box.sizes)
        items.append(RegionData(plan, Region(r.box, job.rank), data))
    return items


@functools.lru_cache(maxsize=64)
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a zarr data type name (bfloat16 and float8 as ``ml_dtypes``' own)."""
    return to_numpy(torch.empty(0, dtype=torch_dtype(name))).dtype


@dataclass(slots=True)
class RegionData:
    """One region this rank writes, with its bytes already in host memory."""

    plan: ArrayPlan
    region: Region
    data: np.ndarray  # C-contiguous, shape == region.box.sizes


def write_rank(
    job: PersistJob,
    items: list[RegionData],
    location: Location,
    store: ObjectStore,
) -> list[dict]:
    """Encode every region's shards (on ``io_threads`` threads), lay them out into this rank's
    packs, write those; returns the receipt entries: each region's box, bytes and crc32c, and
    where each of its shards lies (``"shards": {chunk key: [pack, offset, nbytes]}``)."""
    with gc_paused():  # thousands of small objects made; the write below is I/O (gcpause.py)
        builder, receipt = _lay_out(job, items)
        packs = builder.finish(job.io_threads)
    write_packs(packs, job, location, store)
    return receipt


def _lay_out(job: PersistJob, items: list[RegionData]) -> tuple[PackBuilder, list[dict]]:
    """Every shard encoded and placed in this rank's packs (not written yet); the receipt entries."""
    encoded: list = [None] * len(items)

    def encode(indices: range) -> None:
        for i in indices:
            encoded[i] = _encode(items[i])

    run_parallel([lambda r=r: encode(r) for r in _spans(items, ENCODE_TASK_BYTES)], job.io_threads)
    builder = PackBuilder(lambda index: pack_name(job.rank, index))
    # The documents first, so they are in the rank's first pack: rank 0's holds every one; each
    # other rank's holds those of the arrays it writes, so that pack opens as a zarr store alone.
    written = None if job.rank == 0 else {item.plan.fqn: item.plan for item in items}
    for key, doc in zarr_documents(job.plans if written is None else written, job.step, groups=written is None).items():
        builder.add(key, [doc])
    receipt = []
    for item, (shards, crcs) in zip(items, encoded, strict=True):
        refs = {key: builder.add(f"{array_path(item.plan.fqn)}/{key}", buffers).to_json() for key, buffers in shards}
        receipt.append({**_receipt_entry(item, _region_crc(item, crcs)), "shards": refs})
    return builder, receipt


def _spans(items: list[RegionData], cap: int) -> list[range]:
    """Consecutive items in runs of about ``cap`` bytes: a task per tiny tensor costs more in
    thread hand-offs than encoding it (encoding is crc32c and views)."""
    spans, start, total = [], 0, 0
    for i, item in enumerate(items):
        total += item.data.nbytes
        if total >= cap:
            spans.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(items):
        spans.append(range(start, len(items)))
    return spans


def _encode(item: RegionData) -> tuple[list[tuple[str, list]], list | None]:
    """The region's shard objects [(chunk key, buffers)], and per shard the (crc32c, nbytes) of
    its chunks when the region's crc32c can be made from them (else None)."""
    crcs: list | None = [] if _crc_from_chunks(item) else None
    one = _one_shard(item)
    if one is not None:  # the region is one whole shard (every small tensor): no grid to walk
        pieces: list | None = [] if crcs is not None else None
        buffers = encode_shard(item.data, item.plan.shard_shape, item.plan.inner_shape, pieces)
        return [(one, buffers)], None if pieces is None else [pieces]
    shards = []
    for index, box in shards_in(item.region.box, item.plan.shard_shape):
        pieces: list | None = [] if crcs is not None else None
        shards.append(
            (
                chunk_key(index, format_version=FORMAT_VERSION),
                encode_shard(_within(item, box), item.plan.shard_shape, item.plan.inner_shape, pieces),
            )
        )
        if crcs is not None:
            crcs.append(pieces)
    return shards, crcs


def _one_shard(item: RegionData) -> str | None:
    """The chunk key of the one shard the region is exactly (None: it is not one whole shard)."""
    box, shard = item.region.box, item.plan.shard_shape
    if box.sizes != tuple(shard) or 0 in shard or any(o % s for o, s in zip(box.offsets, shard, strict=True)):
        return None
    return chunk_key(tuple(o // s for o, s in zip(box.offsets, shard, strict=True)), format_version=FORMAT_VERSION)


def _crc_from_chunks(item: RegionData) -> bool:
    """Whether the region's bytes are its inner chunks' in-bounds bytes one after another: true
    when shards and inner chunks span the region in every dimension but the first (row bands)."""
    dims = zip(item.plan.shard_shape[1:], item.plan.inner_shape[1:], item.region.box.sizes[1:], strict=True)
    return all(shard == inner == size for shard, inner, size in dims)


def _region_crc(item: RegionData, shard_crcs: list | None) -> int | None:
    """The region's crc32c from its shards' chunk crcs (in shard order), None if not made that way."""
    if not shard_crcs:
        return None
    if len(shard_crcs) == 1 and len(shard_crcs[0]) == 1 and shard_crcs[0][0][1] == item.data.nbytes:
        return shard_crcs[0][0][0]  # one chunk holding exactly the region's bytes: its crc is the region's
    pieces = [piece for crcs in shard_crcs for piece in crcs]
    if sum(nbytes for _, nbytes in pieces) != item.data.nbytes:
        return None  # the chunks are not the region's bytes after all: read them (never expected)
    return crc32c_concat(pieces)


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


def zarr_documents(plans: dict[str, ArrayPlan], step: int, *, groups: bool = True) -> dict[str, bytes]:
    """``zarr.json`` of every array of ``plans`` and (``groups``) of the attempt group and every
    intermediate group, by key under the attempt (so plain zarr-python opens the group), each
    encoded as ``json.dumps`` encodes the document. Arrays of one shape, dtype and chunking share
    their document up to the attributes, so it is encoded once per such kind, not per array."""
    group = json.dumps(zarr_group_document()).encode()
    docs = {"zarr.json": json.dumps(zarr_group_document({"resilient_step": step})).encode()} if groups else {}
    heads: dict[tuple, str] = {}
    for fqn, plan in plans.items():
        path = array_path(fqn)
        if groups:
            parts = path.split("/")
            for depth in range(1, len(parts)):
                docs.setdefault("/".join(parts[:depth]) + "/zarr.json", group)
        kind = (plan.shape, plan.dtype, plan.shard_shape, plan.inner_shape)
        head = heads.get(kind)
        if head is None:  # the document with empty attributes, cut before them: '..."attributes": '
            head = heads[kind] = json.dumps(zarr_array_document(plan_metadata(plan), {}))[: -len("{}}")]
        docs[path + "/zarr.json"] = f'{head}{{"fqn": {json.dumps(fqn)}}}}}'.encode()
    return docs
