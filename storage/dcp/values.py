"""Non-tensor entries of a DCP state dict, and the one mapping both DCP and our Checkpointer read.

DCP flattens a state dict per leaf ("optim.param_groups.0.lr"); our Checkpointer keeps a dict or
list that holds no tensor as one JSON value ("optim.param_groups"). A step stores values the
Checkpointer's way, so ``Checkpointer.load`` reads a plugin-written step; the reader hands DCP's
load planner the leaves it asks for by expanding each stored value the way DCP flattens
(``dcp_leaves``). Values that are not JSON travel as marked blobs (``StoredValue``), never as
something a reader of the format must unpickle.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from resilient.errors import StateError
from resilient.state import check_json_value

JSON = "json"
BYTES = "bytes"  # a ``bytes`` value, stored raw
BYTESIO = "BytesIO"  # an ``io.BytesIO`` value, stored raw
TORCH_SAVE = "torch.save"  # DCP's default planner pickled the value: opaque to everything of ours
ENCODINGS = (JSON, BYTES, BYTESIO, TORCH_SAVE)


class StoredValue(io.BytesIO):
    """The bytes of a non-tensor value with how they encode it. A BytesIO, as DCP's protocol
    passes non-tensor data, so a storage plugin that knows nothing of it still writes the bytes."""

    def __init__(self, encoding: str, payload: bytes) -> None:
        super().__init__(payload)
        self.encoding = encoding


def encode(fqn: str, value: Any) -> StoredValue:
    """How our save planner stores a non-tensor value: JSON, or raw bytes; anything else refused."""
    if isinstance(value, io.BytesIO):
        return StoredValue(BYTESIO, value.getvalue())
    if isinstance(value, (bytes, bytearray)):
        return StoredValue(BYTES, bytes(value))
    check_json_value(value, fqn)
    return StoredValue(JSON, json.dumps(value).encode())


def decode(fqn: str, encoding: str, payload: bytes) -> Any:
    """The value our load planner puts back; a pickled blob is refused (it would run code)."""
    if encoding == JSON:
        return json.loads(payload)
    if encoding == BYTES:
        return payload
    if encoding == BYTESIO:
        return io.BytesIO(payload)
    raise StateError(
        f"{fqn!r} was saved by DCP's default planner as a pickled blob; resilient.dcp.LoadPlanner never "
        "unpickles: load it with DCP's DefaultLoadPlanner and StorageReader(..., trust_pickle=True), "
        "or save with resilient.dcp.SavePlanner"
    )


def as_torch_save(encoding: str, payload: bytes) -> io.BytesIO:
    """What DCP's default load planner expects (it ``torch.load``s every value): our own pickle of
    a plain value (built here, from JSON or raw bytes), or the stored pickle as it was saved."""
    if encoding == TORCH_SAVE:
        return io.BytesIO(payload)
    out = io.BytesIO()
    torch.save(decode("", encoding, payload), out)
    out.seek(0)
    return out


def like(template: Any, value: Any) -> Any:
    """``value`` with the tuples ``template`` had where JSON gave back lists (AdamW's betas)."""
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(like(t, v) for t, v in zip(template, value, strict=False)) + tuple(value[len(template) :])
    if isinstance(template, list) and isinstance(value, list):
        return [like(t, v) for t, v in zip(template, value, strict=False)] + value[len(template) :]
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: like(template[k], v) if k in template else v for k, v in value.items()}
    return value


# -- DCP's flattening rule -----------------------------------------------------------------------


def _terminal_list(value: list) -> bool:
    """DCP keeps a list whole unless a dict sits in it (at any list depth), as it flattens."""
    return not any(isinstance(v, Mapping) or (isinstance(v, list) and not _terminal_list(v)) for v in value)


def dcp_leaves(path: tuple, value: Any) -> Iterator[tuple[tuple, Any]]:
    """The (path, value) leaves DCP's ``flatten_state_dict`` makes of a tensor-free ``value``."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from dcp_leaves((*path, key), item)
    elif isinstance(value, list) and not _terminal_list(value):
        for i, item in enumerate(value):
            yield from dcp_leaves((*path, i), item)
    else:
        yield path, value


def fqn_of(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def group_values(state: Mapping, mappings: dict[str, tuple], tensor_fqns: set[str]) -> dict[str, tuple]:
    """Our mapping of DCP's non-tensor leaves: {stored fqn: path}. A leaf belongs to the shortest
    prefix of its path under which no tensor sits (what our Checkpointer stores as one value),
    when that whole subtree is JSON-able; otherwise each leaf is stored on its own."""
    tensor_prefixes = {mappings[f][:i] for f in tensor_fqns for i in range(1, len(mappings[f]) + 1)}
    out: dict[str, tuple] = {}
    whole: dict[tuple, bool] = {}  # subtree -> JSON-able, checked once (not once per leaf under it)
    for fqn, path in mappings.items():
        if fqn in tensor_fqns:
            continue
        top = next(path[:i] for i in range(1, len(path) + 1) if path[:i] not in tensor_prefixes)
        if top != path and top not in whole:
            whole[top] = _json_able(value_at(state, top))
        if top != path and whole[top]:
            out[fqn_of(top)] = top
        else:
            out[fqn] = path
    return out


def _json_able(value: Any) -> bool:
    try:
        check_json_value(value, "")
    except StateError:
        return False
    return True


def value_at(state: Any, path: tuple) -> Any:
    """The object at ``path`` of a nested state (dict keys and list indices)."""
    for key in path:
        state = state[key]
    return state
