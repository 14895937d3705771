"""Write a resilient checkpoint from a stream of blocks, in bounded memory, as a normal committed step.

The offline tools (convert, reshard) have no ranks and no snapshot: they create each array with
TensorStore, write it shard by shard (each shard object whole, in one write: a partial shard write
would be a read-modify-write of the object), record the crc32c of every shard's raw bytes as its
region, then write the zarr documents and commit the manifest with the same protocol as
``Checkpointer`` (create-if-absent ``manifest.json``, then ``latest``). A crash before the commit
leaves an orphan attempt that ``resilient-ckpt prune`` removes.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np

from resilient.dtypes import itemsize
from resilient.errors import CommitError, ConfigError
from resilient.layout import DEFAULT_INNER_CHUNK_BYTES, ArrayPlan, Box, Region, choose_inner_shape, edge_grid
from resilient.manifest import MANIFEST, Manifest, array_path, library_versions, step_dir
from resilient.storage.arrays import make_context, open_array, plan_metadata
from resilient.storage.commit import commit_manifest, manifest_entry
from resilient.storage.objects import open_store
from resilient.storage.offline.sources import SourceState, TensorInfo
from resilient.storage.offline.streaming import grid_boxes
from resilient.storage.persist import write_zarr_documents
from resilient.storage.url import Location

Layout = Callable[[TensorInfo], tuple[tuple[int, ...], tuple[int, ...]]]  # info -> (shard, inner)


def _aligned_split(n: int, need: int) -> int:
    """A length near n / need that divides n (keeps source alignment), unless none is close."""
    ideal = max(1, math.ceil(n / need))
    divisor = next((k for k in range(need, n + 1) if n % k == 0), n)
    return n // divisor if 2 * (n // divisor) >= ideal else ideal


def output_shard_shape(shape: tuple[int, ...], boxes: list[Box], item: int, max_bytes: int) -> tuple[int, ...]:
    """Shards aligned with the source's own chunk edges, split along dim 0 first (then dim 1, ...)
    until one shard is at most ``max_bytes``: each is written whole from one block in memory."""
    shard = edge_grid(shape, boxes)
    for d in range(len(shard)):
        nbytes = math.prod(shard) * item
        if nbytes <= max_bytes:
            break
        shard[d] = _aligned_split(shard[d], math.ceil(nbytes / max_bytes))
    return tuple(shard)


def default_layout(shard_bytes: int, inner_bytes: int = DEFAULT_INNER_CHUNK_BYTES) -> Layout:
    def layout(info: TensorInfo) -> tuple[tuple[int, ...], tuple[int, ...]]:
        item = itemsize(info.dtype)
        shard = output_shard_shape(info.shape, list(info.chunks) or [info.whole], item, shard_bytes)
        return shard, choose_inner_shape(shard, item, inner_bytes)

    return layout


class _Write:
    """A pending TensorStore write that keeps its source array alive until it has landed."""

    def __init__(self, future: Any, data: np.ndarray) -> None:
        self._future, self._data = future, data

    def result(self) -> None:
        self._future.result()
        self._data = None


class ResilientSink:
    """Writes one new step under ``location``; ``finish`` commits it."""

    format = "resilient"

    def __init__(self, location: Location, step: int, layout: Layout) -> None:
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"output step must be a non-negative integer, got {step!r}")
        self.location, self.step, self.layout = location, step, layout
        self.store = open_store(location)
        self.store.check_root(create=True)
        if self.store.exists(f"{step_dir(step)}/{MANIFEST}"):
            raise CommitError(
                f"step {step} is already committed at {location.url}; write to another root or choose "
                "another step (--out-step)"
            )
        self.attempt = f"attempt-{uuid.uuid4().hex[:16]}"
        self.attempt_key = f"{step_dir(step)}/{self.attempt}"
        self._context = make_context(location)
        self.plans: dict[str, ArrayPlan] = {}
        self._infos: dict[str, TensorInfo] = {}
        self._opened: dict[str, Any] = {}
        self._crcs: dict[tuple[str, tuple[int, ...]], int] = {}
        self._state, self._metadata = SourceState(), {}

    @property
    def url(self) -> str:
        return f"{self.location.url}/{step_dir(self.step)}"

    def begin(self, infos: list[TensorInfo], state: SourceState, metadata: dict) -> None:
        self._state, self._metadata = state, metadata
        for info in infos:
            shard, inner = self.layout(info)
            plan = ArrayPlan(
                info.fqn,
                info.shape,
                info.dtype,
                shard,
                inner,
                info.placements,
                info.mesh_shape,
                info.mesh_dim_names,
                [Region(b, 0) for b in grid_boxes(info.shape, shard)],
            )
            self.plans[info.fqn], self._infos[info.fqn] = plan, info
            # Every open is issued before any is awaited: TensorStore overlaps them.
            self._opened[info.fqn] = open_array(
                self.location, f"{self.attempt_key}/{array_path(info.fqn)}", plan_metadata(plan), self._context
            )

    def blocks(self, info: TensorInfo) -> list[Box]:
        return [r.box for r in self.plans[info.fqn].regions]

    def write(self, info: TensorInfo, box: Box, data: np.ndarray) -> _Write:
        data = np.require(data, requirements="C")
        self._crcs[(info.fqn, box.offsets)] = crc32c.crc32c(data.reshape(-1).view(np.uint8))
        store = self._opened[info.fqn].result()
        return _Write(store[box.slices()].write(data), data)

    def finish(self) -> Manifest:
        for future in write_zarr_documents(self.location, self.attempt_key, self.plans, self._context, self.step):
            future.result()
        manifest = Manifest(
            step=self.step,
            attempt=self.attempt,
            world_size=self._state.world_size,
            arrays={fqn: manifest_entry(p, self._crcs) for fqn, p in self.plans.items()},
            values=self._state.values,
            metadata=self._metadata,
            versions=library_versions(),
        )
        commit_manifest(self.store, manifest)
        return manifest
