"""``StorageReader``: DCP's load protocol over our committed steps, with no pickle.

DCP's ``Metadata`` is built from the step's manifest (never unpickled): every array is offered as
one chunk covering the whole tensor, so DCP's planner asks for exactly the box each rank needs
(resharded as usual) and ``reader.read_into`` fills it, verifying every crc32c. Values come from
the manifest's JSON, offered per leaf as DCP flattens them, and from the step's value objects;
a pickled one (saved by DCP's default planner) is handed over only with ``trust_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from resilient.dtypes import torch_dtype
from resilient.errors import IntegrityError, RestoreError, StateError
from resilient.layout import Box
from resilient.manifest import MANIFEST, Manifest, step_dir
from resilient.storage.dcp.address import resolve, split_step
from resilient.storage.dcp.planner import LoadPlanner as _OurLoadPlanner
from resilient.storage.dcp.runtime import Runtime, runtime
from resilient.storage.dcp.values import JSON, TORCH_SAVE, StoredValue, as_torch_save, dcp_leaves, fqn_of
from resilient.storage.dcp.writer import DCP_KEY
from resilient.storage.reader import ReadTarget, read_into
from resilient.storage.retention import list_steps
from resilient.validate import check_int


@dataclass(slots=True)
class _Step:
    """The step a load reads: its manifest and its values by DCP key."""

    manifest: Manifest
    url: str
    json_values: dict[str, Any] = field(default_factory=dict)
    blobs: dict[str, dict] = field(default_factory=dict)

    @property
    def attempt_key(self) -> str:
        return f"{step_dir(self.manifest.step)}/{self.manifest.attempt}"


class StorageReader(_DcpStorageReader):
    """Read a committed step of ``url`` (the newest, or ``step``) with ``dcp.load``."""

    def __init__(
        self,
        url: str | os.PathLike | None = None,
        *,
        step: int | None = None,
        trust_pickle: bool = False,
        storage_options: dict | None = None,
        load_budget_bytes: int = 1 << 30,
    ) -> None:
        super().__init__()
        if step is not None:
            check_int("step", step, 0)
        check_int("load_budget_bytes", load_budget_bytes, 1)
        self.url = os.fspath(url) if url is not None else None
        self.step = step
        self.trust_pickle = bool(trust_pickle)
        self.storage_options = dict(storage_options or {})
        self.load_budget_bytes = load_budget_bytes
        self._root, self._step = self.url, step
        self.checkpoint_id: str | None = None
        self._loaded: _Step | None = None
        if self.url is not None:
            self._check()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._root, self._step = resolve(self.url, self.step, checkpoint_id)
        self.checkpoint_id = os.fspath(checkpoint_id) if checkpoint_id is not None else None
        self._loaded = None
        if checkpoint_id is not None:
            self._check()

    def _check(self) -> None:
        """A missing step or a root that is not ours, said here in one line: raised inside dcp.load,
        it would reach the caller wrapped in DCP's CheckpointException among its tracebacks."""
        committed_step(runtime(self._root_url(), self.storage_options), self._step)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        root, step = resolve(self._root, self._step, None)
        rt = runtime(root, self.storage_options)
        manifest = read_manifest(rt, step)
        rank = kwargs.get("rank")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._loaded = loaded = _Step(manifest, rt.location.url)
        for fqn, stored in manifest.values.items():
            value = stored["value"] if "value" in stored else _per_rank(stored["per_rank"], rank)
            for path, leaf in dcp_leaves((fqn,), value):
                loaded.json_values[fqn_of(path)] = leaf
        loaded.blobs = dict(manifest.metadata.get(DCP_KEY, {}).get("blobs", {}))
        return dcp_metadata(loaded)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuse, before a byte is read, to hand DCP a pickled value it would unpickle."""
        loaded = self._step_read()
        pickled = sorted(
            item.storage_index.fqn
            for item in plan.items
            if item.type == LoadItemType.BYTE_IO
            and loaded.blobs.get(item.storage_index.fqn, {}).get("encoding") == TORCH_SAVE
        )
        if pickled and not self.trust_pickle:
            more = f" and {len(pickled) - 10} more" if len(pickled) > 10 else ""
            shown = ", ".join(repr(k) for k in pickled[:10]) + more
            raise StateError(
                f"step {loaded.manifest.step} of {loaded.url} holds values pickled by DCP's default planner "
                f"({shown}); loading them runs pickle: pass StorageReader(..., trust_pickle=True) if you trust "
                "this checkpoint, or load a state without those keys"
            )
        return dataclasses.replace(plan, storage_data=(loaded.manifest.step, loaded.manifest.attempt))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The coordinator: every rank read the same step. Each rank picks "the newest" itself (DCP
        reads the metadata on every rank); a save that commits meanwhile would split them."""
        chosen = {p.storage_data for p in plans}
        if len(chosen) > 1:
            raise RestoreError(
                f"the ranks read different steps of {self._root_url()} ({sorted(chosen)}): a save committed "
                "while they chose the newest; retry, or pass StorageReader(..., step=N)"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        loaded = self._step_read()
        rt = runtime(self._root_url(), self.storage_options)
        tensors = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
        targets = []
        for item in tensors:
            dest = planner.resolve_tensor(item).detach()
            entry = loaded.manifest.arrays[item.storage_index.fqn]
            targets.append(ReadTarget(entry, Box(tuple(item.storage_offsets), tuple(item.lengths)), dest))
        read_into(
            rt.location,
            loaded.attempt_key,
            targets,
            rt.context,
            step=loaded.manifest.step,
            budget_bytes=self.load_budget_bytes,
        )
        for item, target in zip(tensors, targets, strict=True):
            planner.commit_tensor(item, target.dest)
        objects: dict[str, bytes] = {}
        ours = isinstance(planner, _OurLoadPlanner)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                encoding, payload = self._value(loaded, rt, item.storage_index.fqn, objects)
                planner.load_bytes(item, StoredValue(encoding, payload) if ours else as_torch_save(encoding, payload))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return split_step(checkpoint_id)[1] is not None

    # -- the rest ---------------------------------------------------------------------------

    def _root_url(self) -> str:
        return resolve(self._root, self._step, None)[0]

    def _step_read(self) -> _Step:
        if self._loaded is None:
            raise RestoreError("resilient.dcp.StorageReader: read_metadata() was not called (use dcp.load)")
        return self._loaded

    @staticmethod
    def _value(loaded: _Step, rt: Runtime, fqn: str, objects: dict[str, bytes]) -> tuple[str, bytes]:
        if fqn in loaded.json_values:
            return JSON, json.dumps(loaded.json_values[fqn]).encode()
        blob = loaded.blobs[fqn]
        key = f"{loaded.attempt_key}/{blob['object']}"
        if key not in objects:
            data = rt.store.read(key)
            if data is None:
                copied = {"converted_from", "resharded_from"} & set(loaded.manifest.metadata)
                why = (
                    "resilient-ckpt convert/reshard copy tensors and JSON values, not the values DCP stored as bytes: "
                    "load those from the source step"
                    if copied
                    else "the step is damaged"
                )
                where = f"{loaded.url}/{key}"
                raise IntegrityError(f"value {fqn!r} of step {loaded.manifest.step}: {where} is missing; {why}")
            objects[key] = data
        payload = objects[key][blob["offset"] : blob["offset"] + blob["nbytes"]]
        if len(payload) != blob["nbytes"] or crc32c.crc32c(payload) != blob["crc32c"]:
            raise IntegrityError(
                f"value {fqn!r} of step {loaded.manifest.step} fails its crc32c check ({loaded.url}/{key}); "
                "the step is damaged: load an earlier step"
            )
        return blob["encoding"], payload


def _per_rank(values: list, rank: int) -> Any:
    return values[rank] if rank < len(values) else values[0]


def dcp_metadata(loaded: _Step) -> Metadata:
    """DCP's view of a step: each array as one chunk covering it, each value leaf as bytes."""
    state: dict[str, Any] = {}
    paths: dict[str, tuple] = {}
    for fqn, entry in loaded.manifest.arrays.items():
        shape = torch.Size(entry.shape)
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtype(entry.dtype)),
            size=shape,
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
        )
        paths[fqn] = tuple(fqn.split("."))
    for fqn in (*loaded.json_values, *loaded.blobs):
        state[fqn] = BytesStorageMetadata()
        paths[fqn] = tuple(fqn.split("."))
    return Metadata(state_dict_metadata=state, planner_data=paths)


def committed_step(rt: Runtime, step: int | None) -> int:
    """``step`` if committed (None: the newest committed one), else one line saying why not."""
    rt.store.check_root(create=False)
    if step is not None:
        if not rt.store.exists(f"{step_dir(step)}/{MANIFEST}"):
            _no_step(rt, step)
        return step
    committed = list_steps(rt.store).committed
    if not committed:
        _no_step(rt, None)
    return committed[-1]


def read_manifest(rt: Runtime, step: int | None) -> Manifest:
    """The manifest of ``step`` (None: the newest committed) or one line saying why there is none."""
    step = committed_step(rt, step)
    data = rt.store.read(f"{step_dir(step)}/{MANIFEST}")
    if data is None:
        raise RestoreError(f"step {step} vanished from {rt.location.url} while loading; retry")
    return Manifest.loads(data, where=f"{rt.location.url}/{step_dir(step)}/{MANIFEST}")


def _no_step(rt: Runtime, step: int | None) -> None:
    store, url = rt.store, rt.location.url
    if store.exists(".metadata") or (step is not None and store.exists(f"step-{step}/.metadata")):
        where = url if store.exists(".metadata") else f"{url}/step-{step}"
        raise RestoreError(
            f"{where} is a checkpoint of DCP's own FileSystemWriter, not a resilient root: read it with "
            "dcp.FileSystemReader, or convert it once with `resilient-ckpt convert`"
        )
    listing = list_steps(store)
    if step is None:
        hint = f" ({len(listing.uncommitted)} uncommitted attempt(s) found)" if listing.uncommitted else ""
        raise RestoreError(f"no committed resilient checkpoint under {url}{hint}; nothing to load")
    raise RestoreError(
        f"step {step} is not committed under {url}; committed steps: {listing.committed[-10:] or 'none'}"
    )
