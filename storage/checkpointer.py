"""``Checkpointer``: collective save/load of a nested state into Zarr v3 arrays (DESIGN §4-§6).

save: every rank describes what it holds -> one all-gather -> every rank computes the same plan
(which rank writes which shard-aligned region) -> each rank writes its regions and a receipt ->
rank 0 checks coverage and commits the manifest. load: rank 0 picks the step and broadcasts its
manifest -> each rank reads the boxes its tensors need, on any mesh and world size.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import torch

from resilient import dist
from resilient.dtypes import to_numpy
from resilient.errors import (
    CommitError,
    ConfigError,
    IntegrityError,
    ResilientError,
    RestoreError,
    StateError,
    StorageError,
)
from resilient.layout import ArrayPlan, LocalTensor, describe_json, describe_local, plan_arrays
from resilient.manifest import (
    MANIFEST,
    ArrayEntry,
    Manifest,
    array_path,
    encode_values,
    library_versions,
    step_dir,
)
from resilient.metrics import RestoreStats, SaveStats
from resilient.state import flatten_state
from resilient.storage.arrays import make_context
from resilient.storage.commit import (
    check_coverage,
    commit_manifest,
    wait_for_receipts,
    write_failure,
    write_receipt,
)
from resilient.storage.config import CheckpointerConfig
from resilient.storage.handle import SaveHandle
from resilient.storage.match import match_state
from resilient.storage.objects import open_store
from resilient.storage.reader import ReadTarget, read_into
from resilient.storage.retention import KeepLast, apply_retention, list_steps
from resilient.storage.url import parse_url
from resilient.storage.writer import RegionData, now, region_view, write_regions, write_zarr_documents

log = logging.getLogger(__name__)

_ERRORS = {c.__name__: c for c in (StateError, StorageError, CommitError, ConfigError, RestoreError, IntegrityError)}


def _encode_error(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err)}


def _raise_gathered(errors: list[tuple[int, dict]]) -> None:
    """Raise the first rank's error on every rank, so all ranks fail the same way, together."""
    if not errors:
        return
    rank, err = errors[0]
    cls = _ERRORS.get(err["type"], ResilientError)
    others = f" (and {len(errors) - 1} other rank(s))" if len(errors) > 1 else ""
    raise cls(f"[rank {rank}{others}] {err['message']}")


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
        self._last: SaveHandle | None = None
        self.save_stats: list[SaveStats] = []
        self.restore_stats: list[RestoreStats] = []

    # -- public API --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        self.store.check_root(create=False)
        return list_steps(self.store).committed

    def save(self, step: int, state: dict, *, metadata: dict | None = None) -> SaveHandle:
        """Save ``state`` as ``step``. Returns a handle; ``handle.wait()`` raises if the save failed."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        stats = SaveStats(step=step, rank=self.rank)
        start = now()
        locals_, values, attempt = self._prepare(step, state, metadata)
        plans = self._plan(locals_, values, attempt)
        items = self._snapshot(plans, locals_)
        stats.snapshot_s = now() - start
        handle = SaveHandle(step)
        self._persist_and_commit(step, attempt, plans, items, values, metadata or {}, stats, handle)
        stats.total_s = now() - start
        self.save_stats.append(stats)
        self._last = handle
        return handle

    def load(self, state: dict, step: int | None = None, *, strict: bool = True) -> int:
        """Load the newest committed step (or ``step``) into ``state`` in place; returns the step."""
        start = now()
        chosen, manifest = self._agree_on_manifest(step)
        leaves = flatten_state(state)
        match = match_state(manifest, leaves, url=self.url, strict=strict)
        targets = []
        for fqn, leaf in match.tensors.items():
            local = describe_local(fqn, leaf.value)
            if local.box is not None:
                targets.append(ReadTarget(manifest.arrays[fqn], local.box, local.data))
        attempt_key = f"{step_dir(chosen)}/{manifest.attempt}"
        nbytes = read_into(
            self.location, attempt_key, targets, self._context, step=chosen,
            budget_bytes=self.config.load_budget_bytes,
        )
        match.apply_values(manifest, self.rank)
        stats = RestoreStats(step=chosen, rank=self.rank, bytes_read=nbytes, seconds=now() - start)
        self.restore_stats.append(stats)
        log.info("[rank %d] restored step %d from %s (%d bytes)", self.rank, chosen, self.url, nbytes,
                 extra={"event": "restore", "step": chosen, "source": "persistent"})
        return chosen

    def wait(self) -> None:
        if self._last is not None:
            self._last.wait()

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- save stages -------------------------------------------------------------------------

    def _prepare(self, step: int, state: dict, metadata: dict | None) -> tuple[dict[str, LocalTensor], dict, str]:
        """Describe local state; rank 0 also checks storage and the step. One all-gather; an error
        on any rank is raised on every rank (no rank is left waiting in a collective)."""
        payload: dict = {"error": None, "tensors": [], "values": {}}
        locals_: dict[str, LocalTensor] = {}
        try:
            for fqn, leaf in flatten_state(state).items():
                if leaf.is_tensor:
                    locals_[fqn] = describe_local(fqn, leaf.value.detach())
                else:
                    payload["values"][fqn] = leaf.value
            if metadata is not None:
                json.dumps(metadata)
            payload["tensors"] = [describe_json(t) for t in locals_.values()]
            if self.rank == 0:
                self.store.check_root(create=True)
                if self.store.exists(f"{step_dir(step)}/{MANIFEST}"):
                    raise CommitError(
                        f"step {step} is already committed at {self.url}; a step is written once: "
                        "save under a new step number (or delete it with resilient-ckpt prune)"
                    )
                payload["attempt"] = f"attempt-{uuid.uuid4().hex[:16]}"
        except (ResilientError, TypeError, ValueError) as e:
            if not isinstance(e, ResilientError):
                e = StateError(f"metadata is not JSON-able: {e}")
            payload["error"] = _encode_error(e)
        gathered = [json.loads(p) for p in dist.all_gather_object(json.dumps(payload), self.group)]
        _raise_gathered([(r, p["error"]) for r, p in enumerate(gathered) if p["error"]])
        self._gathered = gathered
        return locals_, payload["values"], gathered[0]["attempt"]

    def _plan(self, locals_: dict[str, LocalTensor], values: dict, attempt: str) -> dict[str, ArrayPlan]:
        return plan_arrays(
            [p["tensors"] for p in self._gathered],
            inner_chunk_bytes=self.config.inner_chunk_bytes,
            max_shard_bytes=self.config.max_shard_bytes,
        )

    def _snapshot(self, plans: dict[str, ArrayPlan], locals_: dict[str, LocalTensor]) -> list[RegionData]:
        """This rank's regions in host memory. (Synchronous save: views of the live tensors.)"""
        items = []
        for fqn, plan in plans.items():
            local = locals_[fqn]
            mine = [r for r in plan.regions if r.writer == self.rank]
            if not mine:
                continue
            host = to_numpy(local.data.to("cpu").contiguous())
            for region in mine:
                items.append(RegionData(plan, region, region_view(host, local.box.offsets, region)))
        return items

    def _persist_and_commit(
        self, step: int, attempt: str, plans: dict[str, ArrayPlan], items: list[RegionData],
        values: dict, metadata: dict, stats: SaveStats, handle: SaveHandle,
    ) -> None:
        attempt_key = f"{step_dir(step)}/{attempt}"
        t0 = now()
        error: BaseException | None = None
        try:
            if self.rank == 0:
                write_zarr_documents(self.location, attempt_key, plans, self._context, step)
            regions = write_regions(self.location, attempt_key, items, self._context)
            stats.bytes_written = sum(r["nbytes"] for r in regions)
            write_receipt(self.store, attempt_key, self.rank, {"rank": self.rank, "regions": regions})
        except Exception as e:  # latched: every rank still joins the outcome broadcast below
            error = e
            write_failure(self.store, attempt_key, self.rank, e)
        stats.persist_s = now() - t0
        t1 = now()
        outcome = None
        if self.rank == 0:
            outcome = {"ok": False, "error": _encode_error(StorageError(f"rank 0 failed to write: {error}"))}
            if error is None:
                try:
                    self._commit(step, attempt, attempt_key, plans, metadata)
                    outcome = {"ok": True}
                except Exception as e:
                    outcome = {"ok": False, "error": _encode_error(e)}
        outcome = dist.broadcast_object(outcome, 0, self.group)
        stats.commit_s = now() - t1
        stats.bytes_total = sum(p.nbytes for p in plans.values())
        if error is not None or not outcome["ok"]:
            stats.outcome = "failed"
            err = error if error is not None else _ERRORS.get(outcome["error"]["type"], CommitError)(
                outcome["error"]["message"])
            if not isinstance(err, ResilientError):
                err = StorageError(f"saving step {step} to {self.url} failed on rank {self.rank}: {err}")
            handle.fail(err)
            raise err
        handle.finish(stats)

    def _commit(self, step: int, attempt: str, attempt_key: str, plans: dict[str, ArrayPlan], metadata: dict) -> None:
        receipts = wait_for_receipts(
            self.store, attempt_key, self.world_size, timeout_s=self.config.commit_timeout_s, step=step
        )
        check_coverage(plans, receipts, step)
        crcs = {(r["fqn"], tuple(r["offsets"])): r["crc32c"] for rec in receipts for r in rec["regions"]}
        arrays = {
            fqn: ArrayEntry(
                fqn=fqn, path=array_path(fqn), shape=list(p.shape), dtype=p.dtype,
                shard_shape=list(p.shard_shape), inner_shape=list(p.inner_shape), nbytes=p.nbytes,
                placements=list(p.placements), mesh_shape=list(p.mesh_shape),
                mesh_dim_names=list(p.mesh_dim_names),
                regions=[
                    {**r.box.to_json(), "writer": r.writer, "crc32c": crcs[(fqn, r.box.offsets)]}
                    for r in p.regions
                ],
            )
            for fqn, p in plans.items()
        }
        manifest = Manifest(
            step=step, attempt=attempt, world_size=self.world_size, arrays=arrays,
            values=encode_values([p["values"] for p in self._gathered]), metadata=metadata,
            versions=library_versions(),
        )
        commit_manifest(self.store, manifest)
        log.info("[rank 0] committed step %d to %s (%d arrays, %d bytes)", step, self.url, len(arrays),
                 manifest.total_bytes, extra={"event": "commit", "step": step})
        try:
            apply_retention(self.store, KeepLast(self.config.keep_last))
        except ResilientError as e:  # the step is committed; a failed cleanup is retried next time
            log.warning("[rank 0] retention after step %d failed: %s", step, e)

    # -- load --------------------------------------------------------------------------------

    def _agree_on_manifest(self, step: int | None) -> tuple[int, Manifest]:
        """Rank 0 picks the step and reads its manifest; every rank gets the same one."""
        payload: dict = {}
        if self.rank == 0:
            try:
                chosen = self._resolve_step(step)
                data = self.store.read(f"{step_dir(chosen)}/{MANIFEST}")
                if data is None:
                    raise RestoreError(f"step {chosen} vanished from {self.url} while loading; retry")
                payload = {"step": chosen, "manifest": data.decode()}
            except ResilientError as e:
                payload = {"error": _encode_error(e)}
        payload = dist.broadcast_object(payload, 0, self.group)
        if "error" in payload:
            _raise_gathered([(0, payload["error"])])
        where = f"{self.url}/{step_dir(payload['step'])}/{MANIFEST}"
        return payload["step"], Manifest.loads(payload["manifest"].encode(), where=where)

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
                f"step {step} is not committed under {self.url}; committed steps: "
                f"{listing.committed[-10:] or 'none'}"
            )
        return step


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
