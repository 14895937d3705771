"""Match a target state against a manifest before reading a byte: every problem in one error."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from resilient.dtypes import zarr_name
from resilient.errors import RestoreError
from resilient.manifest import Manifest
from resilient.state import Leaf, set_leaf

log = logging.getLogger(__name__)
_SHOW = 20


@dataclass(slots=True)
class StateMatch:
    tensors: dict[str, Leaf] = field(default_factory=dict)
    values: dict[str, Leaf] = field(default_factory=dict)

    def apply_values(self, manifest: Manifest, rank: int) -> None:
        for fqn, leaf in self.values.items():
            stored = manifest.values[fqn]
            if "value" in stored:
                set_leaf(leaf, stored["value"])
                continue
            per_rank = stored["per_rank"]
            if len(per_rank) != manifest.world_size or rank >= len(per_rank):
                log.warning(
                    "[rank %d] %r was saved per rank by %d ranks; using rank 0's value", rank, fqn, len(per_rank)
                )
                set_leaf(leaf, per_rank[0])
            else:
                set_leaf(leaf, per_rank[rank])


def _listing(label: str, items: list[str]) -> str:
    more = f" ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"{len(items)} {label}: {', '.join(items[:_SHOW])}{more}"


def match_state(manifest: Manifest, leaves: dict[str, Leaf], *, url: str, strict: bool) -> StateMatch:
    match = StateMatch()
    missing, mismatched = [], []
    for fqn, leaf in leaves.items():
        if leaf.is_tensor:
            entry = manifest.arrays.get(fqn)
            if entry is None:
                missing.append(repr(fqn) + (" (stored as a JSON value)" if fqn in manifest.values else ""))
                continue
            shape, dtype = list(leaf.value.shape), zarr_name(leaf.value.dtype, fqn=fqn)
            if shape != entry.shape:
                mismatched.append(f"{fqn!r} shape: checkpoint {entry.shape} vs state {shape}")
                continue
            if dtype != entry.dtype and strict:
                mismatched.append(f"{fqn!r} dtype: checkpoint {entry.dtype} vs state {dtype}")
                continue
            match.tensors[fqn] = leaf
        elif fqn in manifest.values:
            match.values[fqn] = leaf
        else:
            missing.append(repr(fqn) + (" (stored as a tensor)" if fqn in manifest.arrays else ""))
    unexpected = sorted(repr(f) for f in (*manifest.arrays, *manifest.values) if f not in leaves)
    problems = []
    if mismatched:
        problems.append(_listing("mismatch(es)", mismatched))
    if strict and missing:
        problems.append(_listing("key(s) in the state but not in the checkpoint", missing))
    if strict and unexpected:
        problems.append(_listing("key(s) in the checkpoint but not in the state", unexpected))
    if problems:
        hint = " Pass strict=False to load only the matching keys." if not mismatched else ""
        raise RestoreError(
            f"cannot load step {manifest.step} from {url} into this state: " + "; ".join(problems) + "." + hint
        )
    return match
