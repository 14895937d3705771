"""How a rank's tensors are packed into one buffer, and the index that describes and checks them.

Two formats share it: a RAM-tier snapshot (``ram.store`` keeps the buffer in a slot file and the
``SnapshotIndex`` beside it; the buddy copy and the restore check it) and a live heal's state
(``heal_codec``: the same entries in its own JSON index). The layout: the tensors' bytes back to
back, each at a 64-byte aligned offset (``layout_tensors``), each described by a ``TensorEntry``
(FQN, dtype name, shape, offset, nbytes, crc32c) and read back as a view, never a copy
(``tensor_view``). Nothing here is pickled: an index is JSON, a payload raw bytes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c
import torch
from torch.distributed.tensor import DTensor

from resilient.dtypes import itemsize, torch_dtype, zarr_name
from resilient.state import Leaf, held_elsewhere

INDEX_VERSION = 2  # 2: run_id and timeline (an index of version 1 is skipped as unreadable)
ALIGN = 64


@dataclass(slots=True)
class TensorEntry:
    fqn: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    crc32c: int = 0


@dataclass(slots=True)
class SnapshotIndex:
    """What a snapshot holds and how to check it (JSON, one file per snapshot)."""

    step: int
    rank: int
    topology: dict[str, Any]
    tensors: list[TensorEntry]
    values: dict[str, Any]
    slot: str = ""
    nbytes: int = 0
    run_id: str = ""
    timeline: str = ""
    """The run and timeline the snapshot was taken on (``recovery.timeline``): it restores only into them."""
    node_id: str = ""
    """The identity of the node it was taken on (``ram.node_id``; simulated: ``node<N>``)."""
    local_rank: int = -1
    """The taking rank's index on that node."""
    created: float = field(default_factory=time.time)
    version: int = INDEX_VERSION

    def to_json(self) -> dict[str, Any]:
        """The index with ``index_crc32c`` over everything else: the data cursor, RNG and offsets
        are checked too, not only the tensor bytes."""
        body = asdict(self)
        return {**body, "index_crc32c": _json_crc(body)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SnapshotIndex:
        raw = dict(raw)
        if raw.get("version") != INDEX_VERSION:
            raise ValueError(f"snapshot index version {raw.get('version')!r}, expected {INDEX_VERSION}")
        stored = raw.pop("index_crc32c", None)
        if stored != _json_crc(raw):
            raise ValueError("index_crc32c mismatch: the index itself is corrupt")
        tensors = [TensorEntry(**t) for t in raw["tensors"]]
        index = cls(**{**raw, "tensors": tensors})
        index.check_layout()
        return index

    def check_layout(self) -> None:
        """Every tensor inside ``nbytes`` with the byte count its dtype and shape need."""
        for t in self.tensors:
            need = itemsize(t.dtype) * math.prod(t.shape)
            if t.nbytes != need or t.offset < 0 or t.offset + t.nbytes > self.nbytes:
                raise ValueError(f"tensor {t.fqn!r} does not fit the index ({t.offset}+{t.nbytes} of {self.nbytes})")


def _json_crc(body: dict[str, Any]) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def local_tensors(leaves: dict[str, Leaf]) -> dict[str, torch.Tensor]:
    """This rank's own bytes of every tensor leaf (a DTensor's local shard): what a snapshot holds.
    A placeholder (another pipeline stage's parameter) holds no bytes here and is left out."""
    out = {}
    for fqn, leaf in leaves.items():
        if leaf.is_tensor and not held_elsewhere(leaf.value):
            value = leaf.value
            out[fqn] = value.to_local() if isinstance(value, DTensor) else value
    return out


def json_values(leaves: dict[str, Leaf]) -> dict[str, Any]:
    """The non-tensor leaves (data cursor, RNG, counters): a snapshot's index holds them as JSON."""
    return {fqn: leaf.value for fqn, leaf in leaves.items() if not leaf.is_tensor}


def layout_tensors(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Aligned offsets for ``tensors`` (in the given order) and the total size."""
    entries, offset = [], 0
    for fqn, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(fqn, zarr_name(t.dtype, fqn=fqn), list(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def tensor_view(data: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``entry``'s tensor inside the uint8 buffer ``data`` (no copy)."""
    raw = data[entry.offset : entry.offset + entry.nbytes]
    return raw.view(torch_dtype(entry.dtype)).view(entry.shape)


def checksum(data: torch.Tensor, entry: TensorEntry) -> int:
    raw = data[entry.offset : entry.offset + entry.nbytes]
    return crc32c.crc32c(raw.numpy()) if entry.nbytes else 0


class CrcAsItLands:
    """The crc32c of each of ``index``'s tensors, taken from the payload's pieces as they arrive
    in order (each still in cache), instead of a pass over the bytes once they are all there."""

    def __init__(self, index: SnapshotIndex) -> None:
        self.index = index
        self._order = sorted(range(len(index.tensors)), key=lambda i: _span(index.tensors[i]))
        end = 0
        for i in self._order:  # pieces are cut by position: tensors sharing bytes could not be told apart
            entry = index.tensors[i]
            if entry.nbytes and entry.offset < end:
                raise ValueError(f"tensor {entry.fqn!r} overlaps the one before it in the snapshot")
            end = max(end, entry.offset + entry.nbytes)
        if end > index.nbytes:
            raise ValueError(f"the snapshot's tensors end at byte {end}, past its {index.nbytes} bytes")
        self._crcs = [0] * len(index.tensors)
        self._next = 0  # position in _order of the first tensor not yet complete
        self.received = 0

    def __call__(self, piece: memoryview) -> None:
        start, end = self.received, self.received + piece.nbytes
        while self._next < len(self._order):
            i = self._order[self._next]
            entry = self.index.tensors[i]
            low, high = max(entry.offset, start), min(entry.offset + entry.nbytes, end)
            if low < high:
                self._crcs[i] = crc32c.crc32c(piece[low - start : high - start], self._crcs[i])
            if entry.offset + entry.nbytes > end:
                break
            self._next += 1
        self.received = end

    def corruption(self) -> str | None:
        """None if every tensor matches its crc32c; else which does not (all pieces must have landed)."""
        if self.received != self.index.nbytes:
            return f"{self.received} of the snapshot's {self.index.nbytes} bytes were checksummed"
        for crc, entry in zip(self._crcs, self.index.tensors, strict=True):
            if crc != entry.crc32c:
                return f"crc32c mismatch in tensor {entry.fqn!r}"
        return None


def _span(entry: TensorEntry) -> tuple[int, int]:
    """Payload order: by offset, an empty tensor before a non-empty one at the same offset."""
    return entry.offset, entry.nbytes


def first_corruption(index: SnapshotIndex, data: torch.Tensor) -> str | None:
    """None if every tensor's bytes match its crc32c; else which tensor does not."""
    if data.numel() < index.nbytes:
        return f"snapshot data is {data.numel()} bytes, the index says {index.nbytes}"
    for entry in index.tensors:
        if checksum(data, entry) != entry.crc32c:
            return f"crc32c mismatch in tensor {entry.fqn!r}"
    return None
