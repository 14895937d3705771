"""Persist: write this rank's regions of a save plan into zarr arrays, and the zarr.json documents.

All opens are issued before any write and all writes before any wait, so TensorStore keeps the
whole save in flight at once (resolving futures one by one was many times slower here).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import crc32c
import numpy as np

from resilient.faults import fault_point
from resilient.layout import ArrayPlan, Region
from resilient.manifest import array_path
from resilient.storage.arrays import (
    kvstore_spec,
    open_array,
    plan_metadata,
    zarr_array_document,
    zarr_group_document,
)
from resilient.storage.url import Location


@dataclass(slots=True)
class RegionData:
    """One region this rank writes, with its bytes already in host memory."""

    plan: ArrayPlan
    region: Region
    data: np.ndarray  # C-contiguous, shape == region.box.sizes


def write_regions(location: Location, attempt_key: str, items: list[RegionData], context) -> list[dict]:
    """Write every region; returns the receipt entries (fqn, box, bytes, crc32c of the raw bytes)."""
    opened = {}
    for item in items:
        fqn = item.plan.fqn
        if fqn not in opened:
            opened[fqn] = open_array(location, f"{attempt_key}/{array_path(fqn)}", plan_metadata(item.plan), context)
    pending = []
    receipt = []
    for i, item in enumerate(items):
        store = opened[item.plan.fqn].result()
        pending.append(store[item.region.box.slices()].write(item.data))
        receipt.append({
            "fqn": item.plan.fqn,
            **item.region.box.to_json(),
            "nbytes": int(item.data.nbytes),
            "crc32c": crc32c.crc32c(item.data.reshape(-1).view(np.uint8)),
        })
        if i == 0:
            fault_point("persist.first_region_issued")
    for future in pending:
        future.result()
    fault_point("persist.regions_written")
    return receipt


def write_zarr_documents(location: Location, attempt_key: str, plans: dict[str, ArrayPlan], context, step: int) -> list:
    """Start writing ``zarr.json`` for the attempt group, every intermediate group and every array
    (so ``zarr.open_group(<step>/<attempt>)`` works with plain zarr-python); returns the futures."""
    import tensorstore as ts

    kv = ts.KvStore.open(kvstore_spec(location, attempt_key), context=context).result()
    docs: dict[str, dict] = {"zarr.json": zarr_group_document({"resilient_step": step})}
    for fqn, plan in plans.items():
        parts = array_path(fqn).split("/")
        for depth in range(1, len(parts)):
            docs.setdefault("/".join(parts[:depth]) + "/zarr.json", zarr_group_document())
        docs["/".join(parts) + "/zarr.json"] = zarr_array_document(plan_metadata(plan), {"fqn": fqn})
    return [kv.write(key, json.dumps(doc).encode()) for key, doc in docs.items()]


def region_view(local_data: np.ndarray, local_offsets: tuple[int, ...], region: Region) -> np.ndarray:
    """The part of a rank's local tensor that ``region`` covers (a view when possible)."""
    rel = tuple(
        slice(r - o, r - o + s)
        for r, o, s in zip(region.box.offsets, local_offsets, region.box.sizes, strict=True)
    )
    return np.require(local_data[rel], requirements="C")


def now() -> float:
    return time.perf_counter()
