"""Compare two committed steps: keys, shapes, dtypes, values, and every tensor element, streamed.

Tensors are walked in the same C-order blocks on both sides, a bounded number of bytes in flight,
so comparing two 100 GiB checkpoints needs a few hundred MiB. Differences are measured in float64
(exactly for every float type up to float32; integers by exact integer difference); NaN equals
NaN in the same place, NaN against a number counts as an infinite difference.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from resilient.dtypes import itemsize
from resilient.layout import Box
from resilient.storage.offline.catalog import CheckpointRef, select
from resilient.storage.offline.sources import ResilientSource
from resilient.storage.offline.streaming import Both, Pipeline, c_order_blocks


@dataclass(slots=True)
class TensorDiff:
    fqn: str
    numel: int
    changed_elements: int = 0
    max_abs_diff: float = 0.0

    def to_json(self) -> dict:
        big = self.max_abs_diff
        return {
            "fqn": self.fqn,
            "numel": self.numel,
            "changed_elements": self.changed_elements,
            "max_abs_diff": big if math.isfinite(big) else str(big),
        }


def block_difference(a: np.ndarray, b: np.ndarray, atol: float) -> tuple[int, float]:
    """(elements differing by more than ``atol``, the largest absolute difference) of two blocks."""
    a, b = a.reshape(-1), b.reshape(-1)  # 0-d blocks too: numpy would hand back scalars
    if a.dtype.kind in "iu":
        delta = np.abs(a.astype(np.int64) - b.astype(np.int64)).astype(np.float64)
    elif a.dtype.kind == "b":
        delta = (a != b).astype(np.float64)
    else:
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        x, y = a.astype(wide), b.astype(wide)
        with np.errstate(invalid="ignore"):  # inf - inf: fixed up just below
            delta = np.abs(x - y)
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        delta[nan_x & nan_y] = 0.0
        delta[nan_x ^ nan_y] = np.inf
        delta[np.isinf(x) & (x == y)] = 0.0
    if delta.size == 0:
        return 0, 0.0
    return int((delta > atol).sum()), float(delta.max())


def _compare_values(a: dict, b: dict, names: list[str]) -> dict[str, list[str]]:
    def enc(v: dict) -> str:
        return json.dumps(v, sort_keys=True)

    keys_a, keys_b = set(select(sorted(a), names)), set(select(sorted(b), names))
    return {
        "values_added": sorted(keys_b - keys_a),
        "values_removed": sorted(keys_a - keys_b),
        "values_changed": sorted(k for k in keys_a & keys_b if enc(a[k]) != enc(b[k])),
    }


def diff_steps(
    a: CheckpointRef,
    b: CheckpointRef,
    *,
    atol: float = 0.0,
    patterns: list[str] | None = None,
    block_bytes: int = 32 << 20,
    budget_bytes: int = 256 << 20,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Everything that differs between two steps; ``identical`` is True when nothing does."""
    arrays_a, arrays_b = a.manifest.arrays, b.manifest.arrays
    names_a, names_b = set(select(sorted(arrays_a), patterns)), set(select(sorted(arrays_b), patterns))
    common = sorted(names_a & names_b)
    layout_changed = []
    for fqn in common:
        ea, eb = arrays_a[fqn], arrays_b[fqn]
        if ea.shape != eb.shape or ea.dtype != eb.dtype:
            layout_changed.append(
                {"fqn": fqn, "a": {"shape": ea.shape, "dtype": ea.dtype}, "b": {"shape": eb.shape, "dtype": eb.dtype}}
            )
    skip = {d["fqn"] for d in layout_changed}
    diffs = _stream_diffs(a, b, [f for f in common if f not in skip], atol, block_bytes, budget_bytes, progress)
    changed = [d.to_json() for d in diffs if d.changed_elements]
    out = {
        "a": a.url,
        "b": b.url,
        "atol": atol,
        "added": sorted(names_b - names_a),
        "removed": sorted(names_a - names_b),
        "shape_or_dtype_changed": layout_changed,
        "changed": changed,
        "unchanged": len(diffs) - len(changed),
        **_compare_values(a.manifest.values, b.manifest.values, patterns or []),
    }
    out["identical"] = not any(
        out[k]
        for k in (
            "added",
            "removed",
            "shape_or_dtype_changed",
            "changed",
            "values_added",
            "values_removed",
            "values_changed",
        )
    )
    return out


def _stream_diffs(
    a: CheckpointRef,
    b: CheckpointRef,
    fqns: list[str],
    atol: float,
    block_bytes: int,
    budget_bytes: int,
    progress: Callable[[int], None] | None,
) -> list[TensorDiff]:
    src_a, src_b = ResilientSource(a), ResilientSource(b)
    src_a.open(fqns)
    src_b.open(fqns)
    pipeline = Pipeline(budget_bytes)
    results = []
    for fqn in fqns:
        entry = a.manifest.arrays[fqn]
        result = TensorDiff(fqn, math.prod(entry.shape))
        results.append(result)
        item = itemsize(entry.dtype)
        # Blocks sized by their float64 footprint: that is what the comparison allocates.
        whole = Box((0,) * len(entry.shape), tuple(entry.shape))
        for block in c_order_blocks(whole, 8, block_bytes, entry.inner_shape[0] if entry.inner_shape else 1):
            pipeline.add(
                2 * block.numel * item,
                lambda f=fqn, k=block: Both(src_a.read(f, k), src_b.read(f, k)),
                lambda pair, r=result: _fold(r, pair, atol, progress),
            )
    pipeline.drain()
    return results


def _fold(
    result: TensorDiff, pair: tuple[np.ndarray, np.ndarray], atol: float, progress: Callable[[int], None] | None
) -> None:
    changed, biggest = block_difference(pair[0], pair[1], atol)
    result.changed_elements += changed
    result.max_abs_diff = max(result.max_abs_diff, biggest)
    if progress:
        progress(pair[0].nbytes + pair[1].nbytes)
