"""Tensor sources for the offline tools: what a checkpoint holds, and reads of any box of it.

Every format the tools read (resilient, safetensors, torch files, DCP) is a ``TensorSource``: a
list of ``TensorInfo`` (FQN, global shape, dtype, how the source chunks it), the non-tensor state
in the manifest's encoding (``{"value": v}`` or ``{"per_rank": [...]}``), and ``read(fqn, box)``
returning a pending numpy array of exactly that box. Streaming code asks only for boxes, so no
format ever needs a whole tensor in memory unless it stores it that way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from resilient.layout import Box
from resilient.manifest import ArrayEntry
from resilient.storage.arrays import make_context, open_entry, read_error
from resilient.storage.offline.catalog import CheckpointRef
from resilient.storage.offline.streaming import Pending


@dataclass(frozen=True, slots=True)
class TensorInfo:
    fqn: str
    shape: tuple[int, ...]
    dtype: str  # zarr v3 data type name
    chunks: tuple[Box, ...] = ()  # how the source stores it: output layouts align with these edges
    placements: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] = ()

    @property
    def whole(self) -> Box:
        return Box((0,) * len(self.shape), self.shape)


@dataclass(slots=True)
class SourceState:
    """What a source knows besides its tensors."""

    step: int | None = None
    world_size: int = 1
    values: dict[str, dict] = field(default_factory=dict)  # manifest encoding
    metadata: dict = field(default_factory=dict)


class TensorSource(Protocol):
    url: str
    format: str

    def tensors(self) -> list[TensorInfo]: ...
    def state(self) -> SourceState: ...
    def read(self, fqn: str, box: Box) -> Pending: ...
    def close(self) -> None: ...


PACKED_READ_BUDGET_BYTES = 256 << 20
"""Bytes one read of a version 3 box keeps in flight (the box itself is the caller's budget)."""


class _MappedRead:
    """A TensorStore read whose failure becomes IntegrityError/StorageError naming tensor, step, chunk."""

    def __init__(self, future: Any, fqn: str, step: int, url: str) -> None:
        self._future, self._fqn, self._step, self._url = future, fqn, step, url

    def result(self) -> np.ndarray:
        try:
            return self._future.result()
        except Exception as err:
            raise read_error(err, fqn=self._fqn, step=self._step, url=self._url) from err


class _Done:
    def __init__(self, value: np.ndarray) -> None:
        self._value = value

    def result(self) -> np.ndarray:
        return self._value


class _FailedRead:
    def __init__(self, error: Exception) -> None:
        self._error = error

    def result(self) -> np.ndarray:
        raise self._error


class ResilientSource:
    """One committed step of a resilient checkpoint (local or S3): versions 1-2 read through
    TensorStore, version 3 through the Checkpointer's readers."""

    format = "resilient"

    def __init__(self, ref: CheckpointRef) -> None:
        self.ref = ref
        self.url = ref.url
        self._context = make_context(ref.location)
        self._opened: dict[str, Any] = {}

    def tensors(self) -> list[TensorInfo]:
        out = []
        for fqn, a in sorted(self.ref.manifest.arrays.items()):
            chunks = tuple(Box(tuple(r["offsets"]), tuple(r["sizes"])) for r in a.regions)
            out.append(
                TensorInfo(
                    fqn,
                    tuple(a.shape),
                    a.dtype,
                    chunks,
                    tuple(a.placements),
                    tuple(a.mesh_shape),
                    tuple(a.mesh_dim_names),
                )
            )
        return out

    def state(self) -> SourceState:
        m = self.ref.manifest
        return SourceState(step=m.step, world_size=m.world_size, values=dict(m.values), metadata=dict(m.metadata))

    def array_url(self, fqn: str) -> str:
        return f"{self.ref.location.url}/{self.ref.attempt_key}/{self.ref.manifest.arrays[fqn].path}"

    def open(self, fqns: list[str]) -> None:
        """Issue the opens of many arrays at once (resolving them one by one is much slower)."""
        for fqn in fqns:
            if fqn not in self._opened and self.ref.manifest.arrays[fqn].format_version < 3:
                a = self.ref.manifest.arrays[fqn]
                self._opened[fqn] = open_entry(self.ref.location, self.ref.attempt_key, a, self._context)

    def read(self, fqn: str, box: Box) -> Pending:
        entry = self.ref.manifest.arrays[fqn]
        if entry.format_version >= 3:  # packs: the ranged readers, never TensorStore's ZIP path
            return self._read_packed(entry, box)
        self.open([fqn])
        try:
            store = self._opened[fqn].result()
        except Exception as err:
            return _FailedRead(read_error(err, fqn=fqn, step=self.ref.step, url=self.array_url(fqn)))
        return _MappedRead(store[box.slices()].read(), fqn, self.ref.step, self.array_url(fqn))

    def _read_packed(self, entry: ArrayEntry, box: Box) -> Pending:
        """Read a box of a version 3 array now (local: preadv; object storage: ranged reads; each
        opens nothing and reads only the chunks the box needs, where TensorStore's ``zip`` kvstore
        would read the pack's ZIP directory again for every block)."""
        import torch

        from resilient.dtypes import to_numpy, torch_dtype
        from resilient.storage.reader import ReadTarget, read_into

        dest = torch.empty(box.sizes, dtype=torch_dtype(entry.dtype))
        try:
            read_into(
                self.ref.location,
                self.ref.attempt_key,
                [ReadTarget(entry, box, dest)],
                self._context,
                step=self.ref.step,
                budget_bytes=PACKED_READ_BUDGET_BYTES,
            )
        except Exception as err:  # a failed read is reported when its result is asked for
            return _FailedRead(err)
        return _Done(to_numpy(dest))

    def close(self) -> None:
        self._opened.clear()
