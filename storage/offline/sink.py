"""Write a resilient checkpoint from a stream of blocks, in bounded memory, as a normal committed step.

The offline tools (convert, reshard) have no ranks and no snapshot: they write the current format
(version 3) as one writer, rank 0. The plan (each array's shard grid; one block per shard) is
known up front, so the zarr.json documents go first into the first pack, then each block, as it
arrives, is encoded as its shard object and appended to the pack (``packio.PackStream``: a pack
goes out front to back, never held whole in memory), with the crc32c of its raw bytes as its
region. Then the manifest is committed with the same protocol as ``Checkpointer``
(create-if-absent ``manifest.json``, then ``latest``). A crash before the commit leaves an orphan
attempt that ``resilient-ckpt prune`` removes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import crc32c
import numpy as np

from resilient.dtypes import itemsize
from resilient.errors import CommitError, ConfigError
from resilient.layout import DEFAULT_INNER_CHUNK_BYTES, ArrayPlan, Box, Region, choose_inner_shape, edge_grid
from resilient.manifest import FORMAT_VERSION, MANIFEST, Manifest, array_path, library_versions, step_dir
from resilient.storage.arrays import reader_spec
from resilient.storage.commit import commit_manifest, manifest_entry
from resilient.storage.objects import open_store
from resilient.storage.offline.sources import SourceState, TensorInfo
from resilient.storage.offline.streaming import grid_boxes
from resilient.storage.packio import PackStream
from resilient.storage.persist import zarr_documents
from resilient.storage.retention import new_attempt
from resilient.storage.shardfile import chunk_key, encode_shard
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
        self.attempt = new_attempt()
        self.attempt_key = f"{step_dir(step)}/{self.attempt}"
        self.plans: dict[str, ArrayPlan] = {}
        self._packs = PackStream(location, self.store, self.attempt_key)
        self._shards: dict[str, dict[str, list]] = {}
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
            self.plans[info.fqn], self._shards[info.fqn] = plan, {}
        # The documents first: readers find them in the first pack (``arrays.packed_kvstore_spec``).
        for key, doc in zarr_documents(self.plans, self.step).items():
            self._packs.add(key, [doc])

    def blocks(self, info: TensorInfo) -> list[Box]:
        return [r.box for r in self.plans[info.fqn].regions]

    def write(self, info: TensorInfo, box: Box, data: np.ndarray) -> None:
        """Append the shard at ``box`` (one block is one shard) to the pack; nothing stays pending."""
        plan = self.plans[info.fqn]
        data = np.require(data, requirements="C")
        self._crcs[(info.fqn, box.offsets)] = crc32c.crc32c(data.reshape(-1).view(np.uint8))
        index = tuple(o // s for o, s in zip(box.offsets, plan.shard_shape, strict=True))
        key = chunk_key(index, format_version=FORMAT_VERSION)
        buffers = encode_shard(data, plan.shard_shape, plan.inner_shape)
        try:
            self._shards[info.fqn][key] = self._packs.add(f"{array_path(info.fqn)}/{key}", buffers).to_json()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """After an error (here or in the source): the open pack closed, its upload aborted."""
        self._packs.abort()

    def finish(self) -> Manifest:
        try:
            self._packs.close()
        except BaseException:
            self.abort()
            raise
        arrays = {fqn: manifest_entry(p, self._crcs, self._shards[fqn]) for fqn, p in self.plans.items()}
        manifest = Manifest(
            step=self.step,
            attempt=self.attempt,
            world_size=self._state.world_size,
            arrays=arrays,
            values=self._state.values,
            metadata=self._metadata,
            versions=library_versions(),
            tensorstore={fqn: reader_spec(self.location, self.attempt_key, a) for fqn, a in arrays.items()},
        )
        commit_manifest(self.store, manifest)
        return manifest
