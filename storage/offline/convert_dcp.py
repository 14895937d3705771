"""PyTorch Distributed Checkpoint (DCP) in both directions, single process, bounded memory.

Reading: DCP's ``.metadata`` is a pickle, so unpickling it can run code; it is read only when the
caller passes ``trust_pickle`` (``--trust-pickle``). Tensor chunks are then read one by one from
their byte ranges with ``torch.load(weights_only=True)`` and non-tensor entries likewise (one that
needs the full unpickler is skipped and reported, never loaded). DCP flattens nested dicts to
dotted keys; its ``planner_data`` paths are used to regroup tensor-free subtrees into the single
JSON values resilient stores (``{"extra": {"epoch": 3}}`` rather than ``extra.epoch``).

Writing: ``torch.distributed.checkpoint.save`` with no process group and a planner whose write
items are C-order blocks of each tensor, resolved from the source only when DCP writes them, one
item per file; memory stays at a block or two, and the result loads with ``dcp.load`` onto any
world size (DCP reshards chunks on load).
"""

from __future__ import annotations

import io
import os
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from resilient.dtypes import from_numpy, itemsize, torch_dtype, zarr_name
from resilient.errors import ConfigError, IntegrityError, StateError
from resilient.layout import Box
from resilient.state import flatten_state
from resilient.storage.offline.sources import SourceState, TensorInfo
from resilient.storage.offline.streaming import Done, c_order_blocks, numpy_dtype

METADATA = ".metadata"


def _relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(i - o, i - o + n) for i, o, n in zip(inner.offsets, outer.offsets, inner.sizes, strict=True))


def _regroup(paths: dict[str, tuple], tensors: set[str], values: dict[str, Any]) -> tuple[dict[str, str], dict]:
    """Rebuild the nested state from DCP's flattened keys and re-flatten it the resilient way.
    Returns (DCP tensor key -> resilient FQN, resilient values)."""
    tree: dict = {}
    markers: dict[int, str] = {}
    for key in sorted(tensors | set(values)):
        path = paths.get(key) or (key,)
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if key in tensors:
            marker = torch.empty(0)
            markers[id(marker)] = key
            node[path[-1]] = marker
        else:
            node[path[-1]] = values[key]
    leaves = flatten_state(_lists(tree))
    renamed = {markers[id(leaf.value)]: fqn for fqn, leaf in leaves.items() if leaf.is_tensor}
    kept = {fqn: {"value": leaf.value} for fqn, leaf in leaves.items() if not leaf.is_tensor}
    return renamed, kept


def _lists(node: Any) -> Any:
    """Dicts whose keys are 0..n-1 (DCP paths through lists) back into lists."""
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return {str(k): v for k, v in items.items()}


class DcpSource:
    format = "dcp"

    def __init__(self, path: str, *, trust_pickle: bool, cache_bytes: int = 256 << 20) -> None:
        if not trust_pickle:
            raise ConfigError(
                f"reading the DCP checkpoint {path} unpickles its {METADATA} file, which can run arbitrary "
                "code; pass --trust-pickle only if you trust where it came from (tensor data is still "
                "loaded with torch.load(weights_only=True))"
            )
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.url, self.path, self.cache_bytes = path, path, cache_bytes
        try:
            self.metadata = FileSystemReader(path).read_metadata()
        except Exception as e:
            raise IntegrityError(f"cannot read the DCP metadata {os.path.join(path, METADATA)}: {e}") from e
        self._storage = self.metadata.storage_data
        self._cache: OrderedDict[tuple[str, tuple], np.ndarray] = OrderedDict()
        self._cached_bytes = 0
        tensors = {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        values, self.skipped = self._load_values(set(self.metadata.state_dict_metadata) - set(tensors))
        renamed, self._values = _regroup(dict(self.metadata.planner_data or {}), set(tensors), values)
        self._key_of = {fqn: key for key, fqn in renamed.items()}
        self._infos = {}
        for key, md in tensors.items():
            chunks = tuple(Box(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            fqn = renamed[key]
            self._infos[fqn] = TensorInfo(fqn, tuple(md.size), zarr_name(md.properties.dtype, fqn=key), chunks)

    def _bytes_of(self, key: str, offsets: tuple | None) -> bytes:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._storage[MetadataIndex(key, offsets)]
        if getattr(info, "transform_descriptors", None):
            raise ConfigError(
                f"DCP entry {key!r} uses storage extensions {info.transform_descriptors}; "
                "resilient reads plain DCP checkpoints only"
            )
        with open(os.path.join(self.path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise IntegrityError(f"DCP entry {key!r} in {info.relative_path} is truncated")
        return data

    def _load_values(self, keys: set[str]) -> tuple[dict[str, Any], list[str]]:
        values, skipped = {}, []
        for key in sorted(keys):
            try:
                values[key] = torch.load(io.BytesIO(self._bytes_of(key, None)), weights_only=True)
            except (RuntimeError, ValueError, TypeError, AttributeError) as e:
                if "weights_only" not in str(e) and "Unsupported" not in str(e):
                    raise
                skipped.append(key)  # an arbitrary pickled object: we do not unpickle those
        for key in list(values):
            try:
                flatten_state({"v": values[key]})
            except StateError:
                values.pop(key)
                skipped.append(key)
        return values, sorted(skipped)

    def tensors(self) -> list[TensorInfo]:
        return [self._infos[k] for k in sorted(self._infos)]

    def state(self) -> SourceState:
        meta = {"dcp_skipped_entries": self.skipped} if self.skipped else {}
        return SourceState(step=None, world_size=1, values=self._values, metadata=meta)

    def _chunk(self, fqn: str, chunk: Box) -> np.ndarray:
        key = (fqn, chunk.offsets)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        blob = io.BytesIO(self._bytes_of(self._key_of[fqn], chunk.offsets))
        tensor = torch.load(blob, map_location="cpu", weights_only=True)  # tensors only, never arbitrary objects
        from resilient.dtypes import to_numpy

        array = to_numpy(tensor.contiguous())
        while self._cache and self._cached_bytes + array.nbytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
        self._cache[key] = array
        self._cached_bytes += array.nbytes
        return array

    def read(self, fqn: str, box: Box) -> Done:
        info = self._infos[fqn]
        out = np.empty(box.sizes, numpy_dtype(info.dtype))
        for chunk in info.chunks:
            inter = box.intersect(chunk) if box.sizes else chunk
            if inter is not None:
                out[_relative(inter, box)] = self._chunk(fqn, chunk)[_relative(inter, chunk)]
        return Done(out)

    def close(self) -> None:
        self._cache.clear()
        self._cached_bytes = 0


# -- export -----------------------------------------------------------------------------------


def _dcp_values(values: dict[str, dict]) -> dict[str, tuple[tuple, Any]]:
    """Resilient JSON values as DCP would have flattened them: key -> (path, value)."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    out: dict[str, tuple[tuple, Any]] = {}
    for fqn, stored in values.items():
        value = stored["value"] if "value" in stored else stored["per_rank"]

        def visit(path: tuple, leaf: Any, fqn: str = fqn) -> None:
            full = (fqn, *path[1:])
            out[".".join(map(str, full))] = (full, leaf)

        traverse_state_dict({fqn: value}, visit)
    return out


def _write_items(info: TensorInfo, block_bytes: int) -> list[Any]:
    """DCP write items of one tensor: whole, or C-order blocks of at most ``block_bytes``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    size = torch.Size(info.shape)
    props = TensorProperties(dtype=torch_dtype(info.dtype))
    boxes = list(c_order_blocks(info.whole, itemsize(info.dtype), block_bytes)) or [info.whole]
    kind = WriteItemType.TENSOR if len(boxes) == 1 else WriteItemType.SHARD
    return [
        WriteItem(
            index=MetadataIndex(info.fqn, box.offsets),
            type=kind,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)),
                properties=props,
                size=size,
            ),
        )
        for box in boxes
    ]


def write_dcp(
    source: Any,
    infos: list[TensorInfo],
    casts: dict[str, Any],
    state: SourceState,
    directory: str,
    *,
    block_bytes: int,
    on_block: Any = None,
) -> dict:
    """Write ``infos`` (read from ``source``, cast by ``casts[fqn](array)``) as a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    by_fqn = {i.fqn: i for i in infos}
    values = _dcp_values(state.values)

    class StreamingPlanner(DefaultSavePlanner):
        def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
            self.state_dict, self.is_coordinator = {}, is_coordinator
            self.mappings = {**{f: (f,) for f in by_fqn}, **{k: path for k, (path, _) in values.items()}}

        def create_local_plan(self) -> SavePlan:
            items = [item for info in infos for item in _write_items(info, block_bytes)]
            items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in values]
            self.plan = SavePlan(items, planner_data=self.mappings)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
            fqn = write_item.index.fqn
            if write_item.type == WriteItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(values[fqn][1], buffer)
                return buffer
            chunk = write_item.tensor_data.chunk
            box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            array = casts[fqn](source.read(fqn, box).result())
            if on_block is not None:
                on_block(array.nbytes)
            return from_numpy(np.require(array, requirements="C"), torch_dtype(by_fqn[fqn].dtype))

    os.makedirs(directory, exist_ok=True)
    # One item per file: FileSystemWriter keeps every tensor of a file referenced until the file is done.
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=False, thread_count=1)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save({}, storage_writer=writer, planner=StreamingPlanner(), no_dist=True)
    return {"files": sorted(os.listdir(directory)), "values": sorted(values)}
