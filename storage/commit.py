"""Stage 3 of a save (DESIGN §5, §6), commit: receipts -> coverage check -> manifest -> latest.

Each rank writes its shards under the attempt prefix, then a small JSON receipt of what it wrote.
The coordinator (rank 0, ``commit_step``) waits for every receipt (files, not collectives: this
also runs on background threads, where a collective on the training process group could
deadlock), checks that every shard of every array is covered exactly once, and only then creates
``manifest.json`` with an atomic create-if-absent. A kill at any instant before that leaves the
previous step as it was. The other ranks (``wait_for_commit``) count their save as done once the
manifest names their attempt, and give up early when a failure marker says it never will.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from resilient.errors import CommitError
from resilient.faults import fault_point
from resilient.layout import ArrayPlan, Box
from resilient.manifest import (
    LATEST,
    MANIFEST,
    ArrayEntry,
    Manifest,
    array_path,
    encode_values,
    library_versions,
    step_dir,
)
from resilient.storage.objects import ObjectStore
from resilient.storage.retention import KeepLast, apply_retention

if TYPE_CHECKING:  # persist.py imports this module: the job type is for annotations only
    from resilient.storage.persist import PersistJob

log = logging.getLogger(__name__)
RECEIPTS = "receipts"
FAILURES = "failures"
COMMIT_RANK = -1  # failure marker name used by the coordinator when the commit itself fails


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


def poll_cap_s(store: ObjectStore) -> float:
    """Longest sleep between polls: a local poll costs a stat, so poll often (the last receipt's
    wait is pure commit latency); an S3 poll costs requests, so back off further."""
    return 0.01 if store.location.scheme in ("file", "memory") else 0.2


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
        delay = min(delay * 2, poll_cap_s(store))


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


# -- the coordinator's side ----------------------------------------------------------------------


def commit_step(job: PersistJob, store: ObjectStore) -> None:
    """Rank 0: commit ``job``'s step once every rank's receipt is in, then apply retention. On
    failure a marker (``COMMIT_RANK``) tells the waiting ranks to stop waiting."""
    try:
        _commit(job, store)
    except Exception as e:
        write_failure(store, job.attempt_key, COMMIT_RANK, e)
        raise


def _commit(job: PersistJob, store: ObjectStore) -> None:
    receipts = wait_for_receipts(store, job.attempt_key, job.world_size, timeout_s=job.commit_timeout_s, step=job.step)
    check_coverage(job.plans, receipts, job.step)
    fault_point("commit.before_manifest")
    crcs = {(r["fqn"], tuple(r["offsets"])): r["crc32c"] for rec in receipts for r in rec["regions"]}
    arrays = {fqn: manifest_entry(p, crcs) for fqn, p in job.plans.items()}
    manifest = Manifest(
        step=job.step,
        attempt=job.attempt,
        world_size=job.world_size,
        arrays=arrays,
        values=encode_values(job.values),
        metadata=job.metadata,
        versions=library_versions(),
    )
    commit_manifest(store, manifest)
    log.info(
        "[rank 0] committed step %d to %s (%d arrays, %.1f MiB)",
        job.step,
        store.location.url,
        len(arrays),
        manifest.total_bytes / 2**20,
        extra={"event": "commit", "step": job.step},
    )
    try:
        apply_retention(store, KeepLast(job.keep_last))
    except Exception as e:  # noqa: BLE001 - the step is committed: cleanup is retried after the next commit and never decides the save
        log.warning("[rank 0] retention after step %d failed: %s", job.step, e)


def manifest_entry(p: ArrayPlan, crcs: dict) -> ArrayEntry:
    """The manifest entry of a planned array, with each region's crc32c (keyed by (fqn, offsets))."""
    return ArrayEntry(
        fqn=p.fqn,
        path=array_path(p.fqn),
        shape=list(p.shape),
        dtype=p.dtype,
        shard_shape=list(p.shard_shape),
        inner_shape=list(p.inner_shape),
        nbytes=p.nbytes,
        placements=list(p.placements),
        mesh_shape=list(p.mesh_shape),
        mesh_dim_names=list(p.mesh_dim_names),
        regions=[{**r.box.to_json(), "writer": r.writer, "crc32c": crcs[(p.fqn, r.box.offsets)]} for r in p.regions],
    )


# -- everyone else's side ------------------------------------------------------------------------


def wait_for_commit(job: PersistJob, store: ObjectStore) -> None:
    """Non-coordinators: the save counts as done once the manifest names this attempt."""
    key = f"{step_dir(job.step)}/{MANIFEST}"
    deadline = time.monotonic() + job.commit_timeout_s
    delay, polls = 0.002, 0
    while True:
        polls += 1
        data = store.read(key)
        if data is not None:
            if json.loads(data).get("attempt") != job.attempt:
                raise CommitError(f"step {job.step} was committed by another attempt; this save was discarded")
            return
        # A listing costs more than a read: look for failure markers on every 8th poll only.
        failures = store.list_children(f"{job.attempt_key}/{FAILURES}") if polls % 8 == 0 else []
        if failures:
            first = json.loads(store.read(f"{job.attempt_key}/{FAILURES}/{failures[0]}") or b"{}")
            who = "the commit" if first.get("rank") == COMMIT_RANK else f"rank {first.get('rank')}"
            raise CommitError(f"step {job.step} not committed: {who} failed: {first.get('error')}")
        if time.monotonic() > deadline:
            raise CommitError(
                f"step {job.step} not committed within {job.commit_timeout_s:.0f} s (rank 0 never wrote "
                f"{store.location.url}/{key}); the previous step is intact"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
