"""The state model: a nested dict flattened into FQN-keyed leaves, and written back in place.

Leaves are tensors (plain or DTensor) or JSON-able values; a dict or list that holds no tensor
at any depth is one JSON leaf (so an RNG or data-pipeline state loads whole, whatever its keys).
Keys join with '.', like the FQNs of ``get_state_dict`` ("model.layers.0.attn.wq.weight",
"optim.state.<param fqn>.exp_avg"); the FQN with '.' replaced by '/' is the array's path in a
checkpoint.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any

import torch

from resilient.errors import StateError

_JSON_SCALARS = (str, int, float, bool, type(None))


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor this rank names but holds none of (a parameter of another pipeline stage): its
    global shape and dtype, no data (the meta device). In a state passed to ``Checkpointer.save``
    it says "another rank writes this"; in a load target, "skip it here"; it is never read into."""
    return torch.empty(shape, dtype=dtype, device="meta")


def held_elsewhere(value: Any) -> bool:
    """Whether ``value`` is a :func:`placeholder` (a meta tensor)."""
    return isinstance(value, torch.Tensor) and value.is_meta


@dataclass(slots=True)
class Leaf:
    """One leaf of a state tree and where it hangs, so a load can replace it in place."""

    fqn: str
    path: tuple[str, ...]
    value: Any
    parent: Any  # the dict or list that holds the leaf
    key: Any  # the leaf's key (str) or index (int) in ``parent``

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)


def _check_component(part: str, path: tuple[str, ...]) -> None:
    if part == "" or "/" in part:
        where = ".".join(path) or "<root>"
        raise StateError(
            f"state key {part!r} under {where!r} cannot name a checkpoint array: keys must be "
            "non-empty and must not contain '/'; rename the key"
        )


def contains_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(contains_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_tensor(v) for v in value)
    return False


def check_json_value(value: Any, fqn: str) -> None:
    """Raise :class:`StateError` unless ``value`` survives a JSON round trip."""
    if isinstance(value, _JSON_SCALARS):
        if isinstance(value, float) and not math.isfinite(value):
            return  # written as NaN/Infinity, which Python's json reads back
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json_value(item, f"{fqn}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise StateError(
                    f"state value {fqn!r} has a dict key {k!r} of type {type(k).__name__}; JSON "
                    "values need string keys: convert the key or store the dict differently"
                )
            check_json_value(v, f"{fqn}.{k}")
        return
    raise StateError(
        f"state leaf {fqn!r} is a {type(value).__module__}.{type(value).__qualname__}, which is "
        "neither a tensor nor JSON-able (str, int, float, bool, None, list, dict); convert it "
        "(e.g. call .state_dict(), or use resilient.rng.capture_rng_state for RNG states)"
    )


def flatten_state(state: MutableMapping[str, Any]) -> dict[str, Leaf]:
    """Flatten ``state`` into {fqn: Leaf}, rejecting anything that cannot be stored."""
    if not isinstance(state, MutableMapping):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    leaves: dict[str, Leaf] = {}
    for leaf in _walk(state, ()):
        if leaf.fqn in leaves:
            raise StateError(
                f"two state entries flatten to the same name {leaf.fqn!r} (paths "
                f"{leaves[leaf.fqn].path} and {leaf.path}); rename one of them"
            )
        if not leaf.is_tensor:
            check_json_value(leaf.value, leaf.fqn)
        leaves[leaf.fqn] = leaf
    return leaves


def _walk(container: Any, path: tuple[str, ...]) -> Iterator[Leaf]:
    items = container.items() if isinstance(container, MutableMapping) else enumerate(container)
    for key, value in items:
        part = str(key)
        _check_component(part, path)
        child = (*path, part)
        if isinstance(value, MutableMapping) and contains_tensor(value):
            yield from _walk(value, child)
        elif isinstance(value, (list, tuple)) and contains_tensor(value):
            if isinstance(value, tuple):
                raise StateError(
                    f"state entry {'.'.join(child)!r} is a tuple holding tensors; tuples cannot be "
                    "restored in place: use a list or a dict"
                )
            yield from _walk(value, child)
        else:
            yield Leaf(".".join(child), child, value, container, key)


def _like(template: Any, value: Any) -> Any:
    """``value`` with the tuples that ``template`` had where JSON gave back lists."""
    if isinstance(value, list) and isinstance(template, (list, tuple)):
        items = [_like(t, v) for t, v in zip(template, value, strict=False)] + value[len(template) :]
        return tuple(items) if isinstance(template, tuple) else items
    if isinstance(value, dict) and isinstance(template, dict):
        return {k: _like(template[k], v) if k in template else v for k, v in value.items()}
    return value


def set_leaf(leaf: Leaf, value: Any) -> None:
    """Replace a JSON leaf in its parent, keeping tuples tuples (JSON turns them into lists)."""
    value = _like(leaf.value, value)
    if isinstance(leaf.parent, (MutableMapping, MutableSequence)):
        leaf.parent[leaf.key] = value
    else:
        raise StateError(f"cannot restore {leaf.fqn!r} in place: its container is immutable")


def state_digest(state: Any, *, group: Any = None) -> str:
    """sha256 over every tensor of a nested dict, each named by its dotted path: two ranks,
    replicas or runs hold the same bits iff their digests match. The digest of the sorted
    per-tensor hashes, so it does not depend on which rank held which tensor.

    DTensors are gathered whole (``full_tensor``), so under FSDP/TP this is a collective: call it
    on every rank of the mesh. With ``group`` (a pipeline's ranks, each holding other tensors), the
    tensors of every rank of the group count: a collective over it too (the hashes travel as JSON).
    Non-tensor leaves do not count (they are compared as JSON)."""
    hashes = {key: {_tensor_sha256(key, value)} for key, value in _tensor_items(state, "")}
    if group is not None:
        from resilient.dist import all_gather_json

        for part in all_gather_json({k: sorted(v) for k, v in hashes.items()}, group=group):
            for key, values in part.items():
                # A key two ranks hold with different bits keeps both: the digest shows the split.
                hashes.setdefault(key, set()).update(values)
    h = hashlib.sha256()
    for key in sorted(hashes):
        h.update(f"{key}={','.join(sorted(hashes[key]))}\n".encode())
    return h.hexdigest()


def _tensor_sha256(key: str, value: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    full = value.full_tensor() if isinstance(value, DTensor) else value
    h = hashlib.sha256(key.encode())
    h.update(full.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensor_items(state: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        named = [(f"{prefix}.{key}" if prefix else str(key), state[key]) for key in sorted(state, key=str)]
        return [item for name, value in named for item in _tensor_items(value, name)]
    return []
