"""The commit protocol (DESIGN §5): receipts -> coverage check -> manifest -> latest.

Each rank writes its shards under the attempt prefix, then a small JSON receipt of what it wrote.
The coordinator waits for every receipt (files, not collectives: this also runs on background
threads, where a collective on the training process group could deadlock), checks that every
shard of every array is covered exactly once, and only then creates ``manifest.json`` with an
atomic create-if-absent. A kill at any instant before that leaves the previous step as it was.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

import numpy as np

from resilient.errors import CommitError
from resilient.layout import ArrayPlan, Box
from resilient.manifest import LATEST, MANIFEST, Manifest, step_dir
from resilient.storage.objects import ObjectStore

RECEIPTS = "receipts"
FAILURES = "failures"


def receipt_key(attempt_key: str, rank: int) -> str:
    return f"{attempt_key}/{RECEIPTS}/rank-{rank:05d}.json"


def failure_key(attempt_key: str, rank: int) -> str:
    return f"{attempt_key}/{FAILURES}/rank-{rank:05d}.json"


def write_receipt(store: ObjectStore, attempt_key: str, rank: int, receipt: dict) -> None:
    store.write(receipt_key(attempt_key, rank), json.dumps(receipt).encode())


def write_failure(store: ObjectStore, attempt_key: str, rank: int, error: BaseException) -> None:
    """Best effort: tells the coordinator to stop waiting for this rank's receipt."""
    # The failure we report matters more than this one; the commit timeout still applies.
    with contextlib.suppress(Exception):
        store.write(failure_key(attempt_key, rank), json.dumps({"rank": rank, "error": repr(error)}).encode())


def wait_for_receipts(
    store: ObjectStore, attempt_key: str, world_size: int, *, timeout_s: float, step: int
) -> list[dict]:
    """Every rank's receipt, or CommitError naming the ranks that failed or never reported."""
    deadline = time.monotonic() + timeout_s
    receipts: dict[int, dict] = {}
    delay = 0.005
    while True:
        for rank in range(world_size):
            if rank not in receipts:
                data = store.read(receipt_key(attempt_key, rank))
                if data is not None:
                    receipts[rank] = json.loads(data)
        if len(receipts) == world_size:
            return [receipts[r] for r in range(world_size)]
        failures = store.list_children(f"{attempt_key}/{FAILURES}")
        if failures:
            errors = [json.loads(store.read(f"{attempt_key}/{FAILURES}/{f}") or b"{}") for f in failures]
            raise CommitError(
                f"step {step} not committed: rank(s) {[e.get('rank') for e in errors]} failed to "
                f"write their shards: {[e.get('error') for e in errors]}; the previous step is intact"
            )
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(receipts))
            raise CommitError(
                f"step {step} not committed: no receipt from rank(s) {missing} within {timeout_s:.0f} s "
                f"(under {store.location.url}/{attempt_key}); they may have died mid-save. The "
                "previous step is intact; raise checkpoint commit_timeout_s if saves are slow"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def check_coverage(plans: dict[str, ArrayPlan], receipts: list[dict], step: int) -> None:
    """Every shard of every array written exactly once, by the ranks the plan named."""
    written: dict[str, list[Box]] = {fqn: [] for fqn in plans}
    for receipt in receipts:
        for region in receipt["regions"]:
            if region["fqn"] not in written:
                raise CommitError(f"step {step}: rank {receipt['rank']} wrote unplanned tensor {region['fqn']!r}")
            written[region["fqn"]].append(Box(tuple(region["offsets"]), tuple(region["sizes"])))
    for fqn, plan in plans.items():
        if math.prod(plan.shape) == 0:
            continue
        counts = np.zeros(plan.shard_grid(), dtype=np.int32)
        for box in written[fqn]:
            lo = [o // s for o, s in zip(box.offsets, plan.shard_shape, strict=True)]
            hi = [math.ceil((o + n) / s) for o, n, s in zip(box.offsets, box.sizes, plan.shard_shape, strict=True)]
            counts[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))] += 1
        if not (counts == 1).all():
            missing, twice = int((counts == 0).sum()), int((counts > 1).sum())
            raise CommitError(
                f"step {step} not committed: tensor {fqn!r} has {missing} shard(s) never written and "
                f"{twice} written more than once; the previous step is intact"
            )


def commit_manifest(store: ObjectStore, manifest: Manifest) -> None:
    """The commit point: create ``step-N/manifest.json`` iff absent, then advance ``latest``."""
    key = f"{step_dir(manifest.step)}/{MANIFEST}"
    if not store.write_if_absent(key, manifest.dumps()):
        raise CommitError(
            f"step {manifest.step} is already committed at {store.location.url}/{key}; a step is "
            "written once: save under a new step number"
        )
    update_latest(store, manifest.step)


def update_latest(store: ObjectStore, step: int) -> None:
    """Advisory pointer for humans and tools; the manifests are the truth, so it only moves up."""
    current = store.read(LATEST)
    try:
        if current is not None and json.loads(current).get("step", -1) > step:
            return
    except ValueError:
        pass
    store.write(LATEST, json.dumps({"step": step}).encode())
