"""``StorageWriter``: DCP's storage-plugin protocol over our save stages (DESIGN §6).

DCP runs the agreement: every rank plans, the coordinator turns the plans into ours
(``prepare_global_plan``: which rank writes which shard-aligned region, the attempt id), every rank
writes its regions and its receipt straight from the tensors DCP resolves (``write_data``: the
persist stage; no staging copy, ``dcp.async_save`` has staged them already), and the coordinator
commits (``finish``: the commit stage, manifest last). A rank that fails fails DCP's collective,
so every rank raises at the same call and no manifest is written: the previous step stays.

The writer holds only plain settings, so ``dcp.async_save(..., async_checkpointer_type=PROCESS)``
can send it to its checkpoint process; stores and TensorStore contexts are opened where it runs,
once per process and root (``runtime``), not per writer: DCP users make a writer per call.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from resilient.dtypes import to_numpy, zarr_name
from resilient.errors import CommitError, ConfigError, StateError
from resilient.layout import DEFAULT_INNER_CHUNK_BYTES, DEFAULT_MAX_SHARD_BYTES, ArrayPlan, Box, Region, plan_arrays
from resilient.manifest import MANIFEST, step_dir
from resilient.storage.commit import commit_step, write_receipt
from resilient.storage.dcp.address import check_step, resolve, split_step
from resilient.storage.dcp.runtime import Runtime, runtime
from resilient.storage.dcp.values import JSON, TORCH_SAVE, StoredValue
from resilient.storage.persist import PersistJob, RegionData, write_rank
from resilient.storage.retention import new_attempt
from resilient.validate import check_int, check_number

DCP_KEY = "dcp"
"""The manifest metadata key of what a DCP save adds: its non-JSON values (``blobs``)."""


@dataclass(slots=True)
class SaveTask:
    """What the coordinator hands each rank in its ``SavePlan.storage_data``."""

    url: str
    step: int
    attempt: str
    rank: int
    world_size: int
    plans: dict[str, ArrayPlan]


class StorageWriter(_DcpStorageWriter):
    """Write ``dcp.save`` / ``dcp.async_save`` as committed step ``step`` of ``url`` (local or
    ``s3://``): our format, checksums, manifest-last commit, ``keep_last`` retention."""

    def __init__(
        self,
        url: str | os.PathLike | None = None,
        *,
        step: int | None = None,
        keep_last: int | None = None,
        storage_options: dict | None = None,
        io_threads: int = 4,
        commit_timeout_s: float = 600.0,
        inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> None:
        super().__init__()
        if keep_last is not None:
            check_int("keep_last", keep_last, 0)  # 0 keeps every step, as in CheckpointerConfig
        check_int("io_threads", io_threads, 1)
        check_number("commit_timeout_s", commit_timeout_s, 0, open_low=True, unit="s")
        if step is not None:
            check_int("step", step, 0)
        self.url = os.fspath(url) if url is not None else None
        self.step = step
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.io_threads = io_threads
        self.commit_timeout_s = commit_timeout_s
        self.inner_chunk_bytes = inner_chunk_bytes
        self.max_shard_bytes = max_shard_bytes
        self._root, self._step = self.url, step
        self.checkpoint_id: str | None = None  # DCP logs it when set
        self._task: SaveTask | None = None  # the coordinator's: what finish() commits
        self.is_coordinator = False  # set by DCP (set_up_storage_writer)
        self._own: dict | None = None  # the coordinator's receipt, kept in memory for finish()
        if self.url is not None and step is not None:
            self._check()

    # -- DCP's protocol ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._root, self._step = resolve(self.url, self.step, checkpoint_id)
        self.checkpoint_id = os.fspath(checkpoint_id) if checkpoint_id is not None else None
        self._task = None
        if checkpoint_id is not None and self._step is not None:
            self._check()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if kwargs.get("use_collectives") is False and _world_size() > 1:
            # Each rank would then plan and commit alone: a step of one rank's pieces, or none.
            raise ConfigError(
                "resilient.dcp.StorageWriter needs DCP's collectives (use_collectives=True): the commit "
                "checks every rank's part at the coordinator"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: our save plan from DCP's (deduplicated) one, and the attempt id."""
        root, step = self._check(create=True)
        arrays = array_plans(plans, inner_chunk_bytes=self.inner_chunk_bytes, max_shard_bytes=self.max_shard_bytes)
        attempt = new_attempt()
        self._task = SaveTask(root, step, attempt, 0, len(plans), arrays)
        return [
            dataclasses.replace(p, storage_data=dataclasses.replace(self._task, rank=r)) for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's regions (and on rank 0 the zarr.json documents), its values, its receipt."""
        task: SaveTask = plan.storage_data
        rt = self._runtime(task.url)
        job = PersistJob(
            step=task.step,
            attempt=task.attempt,
            rank=task.rank,
            world_size=task.world_size,
            plans=task.plans,
            regions=[],
            io_threads=self.io_threads,
        )
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        items = region_data(job, tensors, planner)
        written = write_rank(job, items, rt.location, rt.store)
        results = [WriteResult(i.index, 0, None) for i in tensors]
        results += write_values(job, [i for i in plan.items if i.type == WriteItemType.BYTE_IO], planner, rt)
        receipt = {"rank": job.rank, "regions": written}
        if self.is_coordinator and job.rank == 0:
            # Its packs are durable (write_rank returned): the commit takes its receipt in memory,
            # as the Checkpointer's coordinator does, one synced object fewer per step.
            self._own = receipt
        else:
            write_receipt(rt.store, job.attempt_key, job.rank, receipt)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """The coordinator, once every rank wrote: the commit (manifest last), then retention."""
        task = self._task
        if task is None:
            raise CommitError("finish() without a plan: dcp.save must run prepare_global_plan first")
        values, blobs = {}, {}
        for per_rank in results:
            for result in per_rank:
                stored = result.storage_data
                if isinstance(stored, dict) and JSON in stored:
                    values[result.index.fqn] = json.loads(stored[JSON])
                elif isinstance(stored, dict) and "blob" in stored:
                    blobs[result.index.fqn] = stored["blob"]
        job = PersistJob(
            step=task.step,
            attempt=task.attempt,
            rank=0,
            world_size=task.world_size,
            plans=task.plans,
            regions=[],
            values=[values],
            metadata={DCP_KEY: {"blobs": blobs}} if blobs else {},
            commit_timeout_s=self.commit_timeout_s,
            keep_last=self.keep_last or None,
        )
        own, self._own = self._own, None
        commit_step(job, self._runtime(task.url).store, own=own)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return split_step(checkpoint_id)[1] is not None

    # -- the rest ---------------------------------------------------------------------------

    def _runtime(self, root: str) -> Runtime:
        return runtime(root, self.storage_options)

    def _check(self, *, create: bool = False) -> tuple[str, int]:
        """(root, step), refusing a step already committed in one line: checked when the writer is
        made (inside dcp.save, DCP would wrap the error among its tracebacks) and again by the
        coordinator when it plans (the step may have been committed since)."""
        root, step = resolve(self._root, self._step, None)
        step = check_step(step, "dcp.save through resilient.dcp.StorageWriter")
        store = self._runtime(root).store
        if create:
            store.check_root(create=True)
        if store.exists(f"{step_dir(step)}/{MANIFEST}"):
            raise CommitError(
                f"step {step} is already committed at {store.location.url}; a step is written once: "
                "save under a new step number (committed steps are never overwritten)"
            )
        return root, step


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def array_plans(plans: list[SavePlan], *, inner_chunk_bytes: int, max_shard_bytes: int) -> dict[str, ArrayPlan]:
    """Our plan (shard grid, regions, writers) from DCP's per-rank write items: a rank holds the
    chunk DCP gave it to write (after its dedup), or nothing of a tensor."""
    meta: dict[str, dict] = {}
    held: list[dict[str, Box | None]] = [{} for _ in plans]
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            fqn, data = item.index.fqn, item.tensor_data
            if fqn in held[rank]:
                raise StateError(
                    f"tensor {fqn!r} has several chunks on rank {rank}; resilient.dcp expects one per rank "
                    "(a DTensor or a plain tensor; not a ShardedTensor with several local shards)"
                )
            meta.setdefault(fqn, {"shape": list(data.size), "dtype": zarr_name(data.properties.dtype, fqn=fqn)})
            box = Box(tuple(data.chunk.offsets), tuple(data.chunk.sizes))
            held[rank][fqn] = box if box.numel > 0 else None
    per_rank = [
        [
            {
                "fqn": fqn,
                **meta[fqn],
                "box": box.to_json() if (box := held[rank].get(fqn)) is not None else None,
                "placements": [],
                "mesh_shape": [],
                "mesh_dim_names": [],
            }
            for fqn in meta
        ]
        for rank in range(len(plans))
    ]
    return plan_arrays(per_rank, inner_chunk_bytes=inner_chunk_bytes, max_shard_bytes=max_shard_bytes)


def region_data(job: PersistJob, items: list[WriteItem], planner: SavePlanner) -> list[RegionData]:
    """The regions this rank writes, as host arrays viewing the tensors DCP resolves (a copy only
    off the CPU or for a non-contiguous piece)."""
    by_fqn = {item.index.fqn: item for item in items}
    resolved: dict[str, torch.Tensor] = {}
    out = []
    for plan in job.plans.values():
        for region in plan.regions:
            if region.writer != job.rank:
                continue
            item = by_fqn[plan.fqn]
            if plan.fqn not in resolved:
                resolved[plan.fqn] = planner.resolve_data(item).detach()
            out.append(RegionData(plan, Region(region.box, job.rank), _piece(resolved[plan.fqn], item, region.box)))
    return out


def _piece(data: torch.Tensor, item: WriteItem, box: Box):
    origin = item.tensor_data.chunk.offsets
    rel = tuple(slice(o - c, o - c + n) for o, c, n in zip(box.offsets, origin, box.sizes, strict=True))
    piece = data[rel] if rel else data
    return to_numpy(piece.cpu().contiguous())


def write_values(job: PersistJob, items: list[WriteItem], planner: SavePlanner, rt: Runtime) -> list[WriteResult]:
    """JSON values go to the coordinator in the results (the manifest holds them); every other
    value's bytes go into one object per rank, named with their crc32c in the manifest."""
    results, parts, offset = [], [], 0
    key = f"dcp/values-rank-{job.rank:05d}.bin"
    for item in items:
        data = planner.resolve_data(item)
        payload = data.getvalue()
        encoding = data.encoding if isinstance(data, StoredValue) else TORCH_SAVE
        if encoding == JSON:
            results.append(WriteResult(item.index, len(payload), {JSON: payload.decode()}))
            continue
        blob = {"encoding": encoding, "object": key, "offset": offset, "nbytes": len(payload)}
        blob["crc32c"] = crc32c.crc32c(payload)
        results.append(WriteResult(item.index, len(payload), {"blob": blob}))
        parts.append(payload)
        offset += len(payload)
    if parts:
        rt.store.write(f"{job.attempt_key}/{key}", b"".join(parts))
    return results
