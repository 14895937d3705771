"""The heal state on the wire: tensors as raw bytes plus one JSON index, never pickle.

A live heal ships torchft's whole state (``{"user": ..., "torchft": ...}``) from a peer group. The
payload is::

    index_len(u64) | index JSON | pad to 64 | tensor bytes, back to back at 64-byte aligned offsets

The index is the RAM tier's vocabulary (``snapshot_format.TensorEntry``: dtype name, shape, offset,
nbytes) plus a skeleton of the tree: ``{"tensor": i}`` (a DTensor also names its global shape and
placements), ``{"dict": {...}}``, ``{"list": [...]}`` or ``{"json": value}``. Decoding parses
JSON and views bytes as tensors of whitelisted dtypes: a payload can be wrong, never code. It is
only decoded after the channel verified its MAC (``transport.HealTransport``), and its layout is
checked again here before any tensor is built.

A DTensor travels as its local shard (``LocalShard`` on arrival); ``adopt_shards`` puts it back on
the receiver's own mesh, which has the same layout (same group rank of an identical group).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from resilient.dtypes import itemsize, torch_dtype
from resilient.errors import IntegrityError, RestoreError, StateError
from resilient.recovery.snapshot_format import ALIGN, TensorEntry, layout_tensors, tensor_view
from resilient.state import check_json_value, contains_tensor

FORMAT = "resilient-heal/1"
_LEN = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class LocalShard:
    """A peer's DTensor as received: its local shard, global shape and placements (as text)."""

    tensor: torch.Tensor
    shape: list[int]
    placements: str


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _skeleton(value: Any, fqn: str, tensors: list[torch.Tensor]) -> dict[str, Any]:
    if isinstance(value, DTensor):
        tensors.append(value.to_local())
        return {"tensor": len(tensors) - 1, "shape": list(value.shape), "placements": repr(value.placements)}
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"tensor": len(tensors) - 1}
    if isinstance(value, dict) and contains_tensor(value):
        for key in value:
            if not isinstance(key, str):
                raise StateError(f"heal state key {key!r} under {fqn!r} is not a str; JSON needs string keys")
        return {"dict": {k: _skeleton(v, f"{fqn}.{k}", tensors) for k, v in value.items()}}
    if isinstance(value, (list, tuple)) and contains_tensor(value):
        return {"list": [_skeleton(v, f"{fqn}[{i}]", tensors) for i, v in enumerate(value)]}
    check_json_value(value, fqn)
    return {"json": value}


def encode_state(state: Any) -> bytearray:
    """One buffer holding ``state``: a copy, so the caller may change ``state`` right after."""
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(state, "<heal state>", tensors)
    entries, nbytes = layout_tensors({str(i): t for i, t in enumerate(tensors)})
    index = json.dumps(
        {"format": FORMAT, "skeleton": skeleton, "tensors": [asdict(e) for e in entries], "nbytes": nbytes},
        separators=(",", ":"),
    ).encode()
    head = _aligned(_LEN.size + len(index))
    buffer = bytearray(head + nbytes)
    _LEN.pack_into(buffer, 0, len(index))
    buffer[_LEN.size : _LEN.size + len(index)] = index
    if nbytes:
        data = torch.frombuffer(buffer, dtype=torch.uint8)[head:]
        for entry, tensor in zip(entries, tensors, strict=True):
            tensor_view(data, entry).copy_(tensor.detach())
    return buffer


def _check_entry(raw: Any, data_bytes: int) -> TensorEntry:
    entry = TensorEntry(**raw)
    torch_dtype(entry.dtype)  # StateError for a name outside the whitelist
    if not all(isinstance(d, int) and d >= 0 for d in entry.shape):
        raise ValueError(f"tensor {entry.fqn!r} has a bad shape {entry.shape!r}")
    need = itemsize(entry.dtype) * math.prod(entry.shape)
    if entry.nbytes != need or entry.offset < 0 or entry.offset % ALIGN or entry.offset + need > data_bytes:
        raise ValueError(
            f"tensor {entry.fqn!r} does not fit the payload ({entry.offset}+{entry.nbytes} of {data_bytes})"
        )
    return entry


def _rebuild(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict) or len(node) not in (1, 3):
        raise ValueError(f"malformed skeleton node {str(node)[:80]!r}")
    if "tensor" in node:
        if not isinstance(node["tensor"], int) or node["tensor"] < 0:
            raise ValueError(f"malformed tensor reference {node['tensor']!r}")
        tensor = tensors[node["tensor"]]
        if "shape" in node:
            return LocalShard(tensor, list(node["shape"]), str(node["placements"]))
        return tensor
    if "dict" in node:
        return {str(k): _rebuild(v, tensors) for k, v in node["dict"].items()}
    if "list" in node:
        return [_rebuild(v, tensors) for v in node["list"]]
    return node["json"]


def decode_state(payload: bytearray | memoryview, *, source: str) -> Any:
    """The state in ``payload``; tensors are views into it (no copy; they keep it alive). IntegrityError
    names ``source``."""
    try:
        (index_len,) = _LEN.unpack_from(payload, 0)
        if index_len > len(payload) - _LEN.size:
            raise ValueError(f"index of {index_len} bytes does not fit a payload of {len(payload)}")
        index = json.loads(bytes(payload[_LEN.size : _LEN.size + index_len]))
        if index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format')!r}, expected {FORMAT!r}")
        head = _aligned(_LEN.size + index_len)
        nbytes = index["nbytes"]
        if not isinstance(nbytes, int) or head + nbytes != len(payload):
            raise ValueError(f"payload is {len(payload)} bytes, the index says {head} + {nbytes}")
        entries = [_check_entry(raw, nbytes) for raw in index["tensors"]]
        data = torch.frombuffer(payload, dtype=torch.uint8)[head:] if nbytes else torch.empty(0, dtype=torch.uint8)
        return _rebuild(index["skeleton"], [tensor_view(data, e) for e in entries])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error, StateError) as e:
        raise IntegrityError(f"heal state from {source} is malformed, nothing of it was used: {e}") from e


def adopt_shards(state: Any, like: Any, fqn: str = "") -> Any:
    """``state`` with every ``LocalShard`` made a DTensor on the mesh of the DTensor at the same
    place in ``like`` (this rank's own state); RestoreError if the layouts differ."""
    if isinstance(state, LocalShard):
        if not isinstance(like, DTensor):
            raise RestoreError(f"heal state {fqn!r} is a DTensor shard but this rank's {fqn!r} is not a DTensor")
        local = like.to_local()
        if (
            state.shape != list(like.shape)
            or state.placements != repr(like.placements)
            or state.tensor.shape != local.shape
        ):
            raise RestoreError(
                f"heal state {fqn!r}: peer shard {list(state.tensor.shape)} of {state.shape} {state.placements} "
                f"does not match this rank's {list(local.shape)} of {list(like.shape)} {like.placements!r}; "
                "the groups must have the same parallel layout"
            )
        tensor = state.tensor.to(local.device)
        return DTensor.from_local(tensor, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
    if isinstance(state, dict):
        mine = like if isinstance(like, dict) else {}
        return {k: adopt_shards(v, mine.get(k), f"{fqn}.{k}" if fqn else k) for k, v in state.items()}
    if isinstance(state, list):
        mine = like if isinstance(like, (list, tuple)) else []
        return [adopt_shards(v, mine[i] if i < len(mine) else None, f"{fqn}[{i}]") for i, v in enumerate(state)]
    return state


def has_shards(state: Any) -> bool:
    if isinstance(state, LocalShard):
        return True
    if isinstance(state, dict):
        return any(has_shards(v) for v in state.values())
    if isinstance(state, list):
        return any(has_shards(v) for v in state)
    return False
