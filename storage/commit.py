"""Stage 3 of a save (DESIGN §5, §6), commit: receipts -> coverage check -> manifest -> latest.

Each rank writes its shards under the attempt prefix, then a small JSON receipt of what it wrote.
The coordinator (rank 0, ``commit_step``) waits for every receipt (files, not collectives: this
also runs on background threads, where a collective on the training process group could
deadlock), checks that every shard of every array is covered exactly once, and only then creates
``manifest.json`` with an atomic create-if-absent. A kill at any instant before that leaves the
previous step as it was. The other ranks (``wait_for_commit``) count their save as done once the
manifest names their attempt, and give up early when a failure marker says it never will.

The outcome of a save is decided once, by the coordinator, and every rank learns that decision:
the manifest naming the attempt means committed, the coordinator's decision
marker (``COMMIT_RANK``) means failed, and nothing else does: not another rank's failure marker
(its receipt may have landed although its PUT raised), not ``latest`` (an advisory pointer, DESIGN
§5). A rank whose own part failed still waits for that decision. Every rank measures the commit
timeout from the same agreed deadline (``PersistJob.deadline``): the coordinator starts no commit
after it, and the others wait for its decision, giving up only ``decision_grace_s`` later (a
separate bound, far longer than the coordinator can take), so no rank decides before the
coordinator can.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from resilient.errors import CommitError, disk_full
from resilient.faults import fault_point
from resilient.layout import ArrayPlan, Box
from resilient.manifest import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    ArrayEntry,
    Manifest,
    array_path,
    encode_values,
    library_versions,
    step_dir,
)
from resilient.storage import notice
from resilient.storage.arrays import reader_spec
from resilient.storage.gcpause import gc_paused
from resilient.storage.objects import ObjectStore, write_advisory
from resilient.storage.pack import PACK_MAX_BYTES
from resilient.storage.retention import KeepLast, apply_retention, remember_committed
from resilient.storage.retention_cache import checked_steps
from resilient.storage.s3 import COMMIT_WRITE_BOUND_S
from resilient.storage.shardfile import chunk_key

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
    """Best effort: tells the coordinator to stop waiting for this rank's receipt (the coordinator's
    own: tells the others its decision), in storage and through the job's store (``notice``: a
    full disk refuses the marker too)."""
    record = {"rank": rank, "error": repr(error)}
    notice.post(attempt_key, "decision" if rank == COMMIT_RANK else "rank", record)
    # The failure we report matters more than this one; the commit timeout still applies.
    with contextlib.suppress(Exception):
        store.write(failure_key(attempt_key, rank), json.dumps(record).encode())


def poll_cap_s(scheme: str, world_size: int, configured: float | None = None) -> float:
    """Longest sleep between polls (``configured`` wins). A local poll costs a stat, so a small
    world polls often (the last receipt's wait is pure commit latency); an S3 poll costs requests,
    billed and throttled per prefix, so each rank polls at most ~2 times a second. Both caps grow
    with the world: every rank but one polls, and their sum is what storage sees."""
    if configured is not None:
        return configured
    if scheme in ("file", "memory"):
        return min(0.25, 0.01 * max(1.0, world_size / 16))
    return min(5.0, 0.5 * max(1.0, world_size / 256))


DECISION_WAIT_S = 600.0
"""At least this long after the agreed deadline a waiting rank waits for the coordinator's decision."""


def decision_grace_s(timeout_s: float, scheme: str = "file") -> float:
    """How long after the agreed deadline a waiting rank still waits for the coordinator's decision
    (the coordinator starts no manifest write after the deadline, then writes it or its marker).

    The coordinator's decision is the truth, so this is a bound of its own, far longer than any
    healthy coordinator takes: a waiting rank that gave up first would report "not committed" (and
    restart the run) for a step the coordinator then commits, if its writer thread was starved on a
    saturated host, a write stalled in fsync, or the two nodes' clocks differ. At least
    ``DECISION_WAIT_S`` and the commit timeout itself; on S3 also the longest manifest write
    (``s3.COMMIT_WRITE_BOUND_S``) plus a margin. A coordinator that is gone for good takes its group
    down with it (torchrun), so the bound only matters for a hung one."""
    grace = max(DECISION_WAIT_S, timeout_s)
    return max(grace, COMMIT_WRITE_BOUND_S + 15.0) if scheme == "s3" else grace  # + DNS, scheduling


def _read_json(store: ObjectStore, key: str, *, paused: bool = False) -> dict | None:
    """``key``'s JSON (``{}`` if torn, None if absent); ``paused``: parsed with the collector held
    off (a receipt names every shard its rank wrote), read with it on (the read is I/O)."""
    data = store.read(key)
    if data is None:
        return None
    try:
        if paused:
            with gc_paused():  # gcpause.py
                return json.loads(data)
        return json.loads(data)
    except ValueError:  # a torn marker or receipt still says "there is one"
        return {}


def wait_for_receipts(store: ObjectStore, job: PersistJob, own: dict | None = None) -> list[dict]:
    """Every rank's receipt, or CommitError naming the ranks that failed or never reported by the
    agreed deadline. One listing per poll, and one read per receipt: not a read per missing
    rank per poll (thousands of requests a second at a large world on S3). ``own``: the
    coordinator's receipt, in memory (it writes none)."""
    attempt_key, world_size, step = job.attempt_key, job.world_size, job.step
    job.deadline = job.deadline or time.time() + job.commit_timeout_s
    receipts: dict[int, dict] = {} if own is None else {job.rank: own}
    delay, cap = 0.002, poll_cap_s(store.location.scheme, world_size, job.poll_cap_s)
    ask_at = 0.0  # the notice is read at most once per poll cap (a store round trip per rank per poll)
    while True:
        for name in store.list_children(f"{attempt_key}/{RECEIPTS}"):
            rank = _rank_of(name)
            if rank is None or rank in receipts:
                continue
            got = _read_json(store, f"{attempt_key}/{RECEIPTS}/{name}", paused=True)
            if got:
                receipts[rank] = got
        if len(receipts) >= world_size:
            return [receipts[r] for r in range(world_size)]
        failures = store.list_children(f"{attempt_key}/{FAILURES}")
        noticed = None
        if not failures and time.monotonic() >= ask_at:  # the storage marker missed
            noticed, ask_at = notice.read(attempt_key, "rank"), time.monotonic() + cap
        if failures or noticed:
            errors = [_read_json(store, f"{attempt_key}/{FAILURES}/{f}") or {} for f in failures] or [noticed]
            raise CommitError(
                f"step {step} not committed: rank(s) {[e.get('rank') for e in errors]} failed to "
                f"write their shards: {[e.get('error') for e in errors]}; the previous step is intact"
            )
        if time.time() > job.deadline:
            missing = sorted(set(range(world_size)) - set(receipts))
            raise CommitError(
                f"step {step} not committed: no receipt from rank(s) {missing} within {job.commit_timeout_s:.0f} s "
                f"(under {store.location.url}/{attempt_key}); they may have died mid-save. The "
                "previous step is intact; raise checkpoint.commit_timeout_s if saves are slow"
            )
        time.sleep(delay)
        delay = min(delay * 2, cap)


def _rank_of(name: str) -> int | None:
    """The rank a receipt is named after (``rank-00003.json``), None for anything else."""
    digits = name.removeprefix("rank-").removesuffix(".json")
    return int(digits) if digits.isdigit() else None


def check_coverage(plans: dict[str, ArrayPlan], receipts: list[dict], step: int, *, packed: bool = True) -> None:
    """Every shard of every array written exactly once, by the ranks the plan named; ``packed``
    (format version 3): and each with exactly one sane ref into its writer's packs."""
    written: dict[str, list[Box]] = {fqn: [] for fqn in plans}
    for receipt in receipts:
        for region in receipt["regions"]:
            if region["fqn"] not in written:
                raise CommitError(f"step {step}: rank {receipt['rank']} wrote unplanned tensor {region['fqn']!r}")
            written[region["fqn"]].append(Box(tuple(region["offsets"]), tuple(region["sizes"])))
    for fqn, plan in plans.items():
        if math.prod(plan.shape) == 0:
            continue
        missing, twice = _shard_gaps(plan, written[fqn])
        if missing or twice:
            raise CommitError(
                f"step {step} not committed: tensor {fqn!r} has {missing} shard(s) never written and "
                f"{twice} written more than once; the previous step is intact"
            )
    if packed:
        check_refs(plans, receipts, step)


def check_refs(plans: dict[str, ArrayPlan], receipts: list[dict], step: int) -> None:
    """Every in-bounds shard of every array has exactly one ref (pack, offset, nbytes), in a pack
    of the rank that wrote it, inside a pack's bounds: the regions alone do not say where the
    bytes are, and a manifest with a wrong ref commits a step that cannot load (whose commit then
    lets retention delete the previous good step)."""
    seen: dict[str, dict[str, int]] = {fqn: {} for fqn in plans}
    for receipt in receipts:
        rank = receipt["rank"]
        for region in receipt["regions"]:
            fqn, refs = region["fqn"], region.get("shards")
            where = f"step {step} not committed: tensor {fqn!r}, rank {rank}"
            if not isinstance(refs, dict):
                raise CommitError(f"{where}: the receipt names no shard refs; the previous step is intact")
            for key, ref in refs.items():
                _check_ref(ref, rank, f"{where}, shard {key!r}")
                seen[fqn][key] = seen[fqn].get(key, 0) + 1
    for fqn, plan in plans.items():
        want = _planned_keys(plan)
        got = seen[fqn]
        missing = sorted(want - got.keys())
        wrong = sorted(k for k, n in got.items() if n != 1 or k not in want)
        if missing or wrong:
            raise CommitError(
                f"step {step} not committed: tensor {fqn!r} has no shard ref for {missing[:3]} and a "
                f"duplicate or unplanned one for {wrong[:3]}; the previous step is intact"
            )


def _check_ref(ref: object, rank: int, where: str) -> None:
    """A ref is [pack of this rank, offset, nbytes] with the bytes inside a ZIP32 pack."""
    ok = isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str)
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in ref[1:])
    if not ok:
        raise CommitError(f"{where}: malformed ref {ref!r}; the previous step is intact")
    pack, offset, nbytes = ref
    if not pack.startswith(f"pack-r{rank:05d}-") or "/" in pack:
        raise CommitError(f"{where}: ref names pack {pack!r}, not one of rank {rank}'s; the previous step is intact")
    if offset < 0 or nbytes <= 0 or offset + nbytes > PACK_MAX_BYTES:
        raise CommitError(f"{where}: ref [{offset}, {nbytes}] lies outside a pack; the previous step is intact")


def _planned_keys(plan: ArrayPlan) -> set[str]:
    """The chunk keys of every in-bounds shard of ``plan`` (none for an empty array)."""
    if math.prod(plan.shape) == 0:
        return set()
    grid = plan.shard_grid()
    if math.prod(grid) == 1:  # the common small tensor: no product to build
        return {chunk_key((0,) * len(grid), format_version=FORMAT_VERSION)}
    return {chunk_key(i, format_version=FORMAT_VERSION) for i in itertools.product(*(range(g) for g in grid))}


def _shard_gaps(plan: ArrayPlan, boxes: list[Box]) -> tuple[int, int]:
    """(shards no box covers, shards more than one box covers)."""
    spans = []
    for box in boxes:
        lo = [o // s for o, s in zip(box.offsets, plan.shard_shape, strict=True)]
        hi = [math.ceil((o + n) / s) for o, n, s in zip(box.offsets, box.sizes, plan.shard_shape, strict=True)]
        spans.append((lo, hi))
    grid = plan.shard_grid()
    if math.prod(grid) == 1:  # one shard, as every small tensor has: no numpy grid (benchmarks/README.md)
        # A box covers it iff it starts inside it and is not empty (what the grid's slice [lo:hi] counts).
        covering = sum(all(a == 0 < b for a, b in zip(lo, hi, strict=True)) for lo, hi in spans)
        return int(covering == 0), int(covering > 1)
    counts = np.zeros(grid, dtype=np.int32)
    for lo, hi in spans:
        counts[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))] += 1
    return int((counts == 0).sum()), int((counts > 1).sum())


def commit_manifest(store: ObjectStore, manifest: Manifest, data: bytes | None = None) -> None:
    """The commit point: create ``step-N/manifest.json`` iff absent (holding ``data``, the
    manifest's encoding, when the caller has it), then advance ``latest``.
    Once the manifest is durable the step IS committed: a failed ``latest`` write is logged, never
    raised (it made the coordinator say "failed" while every other rank said "committed"; readers
    list the manifests, and the next commit moves ``latest`` again)."""
    key = f"{step_dir(manifest.step)}/{MANIFEST}"
    data = manifest.dumps() if data is None else data
    if not store.write_if_absent(key, data):
        raise CommitError(
            f"step {manifest.step} is already committed at {store.location.url}/{key}; a step is "
            "written once: save under a new step number"
        )
    remember_committed(store, manifest.step, data, manifest.attempt)
    try:
        update_latest(store, manifest.step)
    except Exception as e:  # noqa: BLE001 - advisory pointer; the manifest above decided the save
        log.warning("[rank 0] step %d committed, but moving %s failed: %s", manifest.step, LATEST, e)


def update_latest(store: ObjectStore, step: int) -> None:
    """Advisory pointer for humans and tools; the manifests are the truth, so it only moves up."""
    current = store.read(LATEST)
    try:
        if current is not None and json.loads(current).get("step", -1) > step:
            return
    except ValueError:
        pass
    write_advisory(store, LATEST, json.dumps({"step": step}).encode())


# -- the coordinator's side ----------------------------------------------------------------------


def commit_step(job: PersistJob, store: ObjectStore, own: dict | None = None) -> None:
    """Rank 0: commit ``job``'s step once every rank's receipt is in (``own``: its own, in memory;
    None: read from storage like the others'), then apply retention. On failure the decision
    marker (``COMMIT_RANK``) tells the waiting ranks it is "failed"."""
    try:
        _commit(job, store, own)
    except Exception as e:
        if names_attempt(store, job):  # the manifest landed although its write raised: committed
            log.warning("[rank 0] step %d: the manifest write raised (%s) but it landed: committed", job.step, e)
            return
        decide_failed(store, job, e)
        raise


def names_attempt(store: ObjectStore, job: PersistJob) -> bool:
    """Whether step ``job.step``'s manifest exists and names this attempt (best effort: False if
    it cannot be read)."""
    try:
        got = _read_json(store, f"{step_dir(job.step)}/{MANIFEST}")
    except Exception:  # noqa: BLE001 - unreadable counts as "not ours": the save is then failed
        return False
    return got is not None and got.get("attempt") == job.attempt


def decide_failed(store: ObjectStore, job: PersistJob, error: BaseException) -> None:
    """The coordinator's decision "not committed", for every rank to read. On a full disk the
    attempt's data goes first: it is never committed now, the marker needs room to land, and the
    next save needs the space (a peer's write still running may fail on the removed directory: it
    then raises its own error, and the agreed one is the coordinator's, which names the disk)."""
    if disk_full(error):
        remove_attempt(store, job)
    write_failure(store, job.attempt_key, COMMIT_RANK, error)
    notice.clear(job.attempt_key, "rank")  # decided: the ranks read the decision, not the notice


def remove_attempt(store: ObjectStore, job: PersistJob) -> None:
    """Best effort: delete what this attempt wrote (a full disk keeps no partial attempt; a peer
    still writing may leave a few objects, removed with the orphans after the next commit). Never
    an attempt a manifest names, or may name (a manifest that cannot be read)."""
    try:
        if store.read(f"{step_dir(job.step)}/{MANIFEST}") is not None:
            return  # this step has a manifest (this attempt's or another's): leave it to retention
        store.delete_prefix(job.attempt_key)
    except Exception as e:  # noqa: BLE001 - the failure being reported matters more than the cleanup
        log.warning("[rank %d] removing the failed attempt %s: %s", job.rank, job.attempt_key, e)


def _commit(job: PersistJob, store: ObjectStore, own: dict | None = None) -> None:
    receipts = wait_for_receipts(store, job, own)
    notice.clear_decisions()  # of earlier attempts: every rank is past them (it wrote this receipt)
    with gc_paused():  # a manifest of thousands of arrays built and encoded; its PUT is I/O (gcpause.py)
        check_coverage(job.plans, receipts, job.step)
        fault_point("commit.before_manifest")
        manifest = build_manifest(job, receipts, store)
        data = manifest.dumps()
    if time.time() > job.deadline:
        raise CommitError(
            f"step {job.step} not committed: every receipt was in only after the agreed "
            f"{job.commit_timeout_s:.0f} s (checkpoint.commit_timeout_s), when the other ranks may have given up"
        )
    commit_manifest(store, manifest, data)
    log.info(
        "[rank 0] committed step %d to %s (%d arrays, %.1f MiB)",
        job.step,
        store.location.url,
        len(manifest.arrays),
        manifest.total_bytes / 2**20,
        extra={"event": "commit", "step": job.step},
    )
    try:
        # Another replica group may be persisting this very step (both restored it): its attempt,
        # younger than a commit can take, is left alone.
        young_s = job.commit_timeout_s + decision_grace_s(job.commit_timeout_s, store.location.scheme)
        known = checked_steps(store.location.url)  # what earlier commits of this process found
        apply_retention(store, KeepLast(job.keep_last), young_s=young_s, known=known)
    except Exception as e:  # noqa: BLE001 - the step is committed: cleanup is retried after the next commit and never decides the save
        log.warning("[rank 0] retention after step %d failed: %s", job.step, e)


def build_manifest(job: PersistJob, receipts: list[dict], store: ObjectStore) -> Manifest:
    """The manifest of ``job``'s step from every rank's receipt (coverage already checked)."""
    crcs = {(r["fqn"], tuple(r["offsets"])): r["crc32c"] for rec in receipts for r in rec["regions"]}
    shards: dict[str, dict] = {fqn: {} for fqn in job.plans}
    for rec in receipts:
        for r in rec["regions"]:
            shards[r["fqn"]].update(r["shards"])
    arrays = {fqn: manifest_entry(p, crcs, shards[fqn]) for fqn, p in job.plans.items()}
    return Manifest(
        step=job.step,
        attempt=job.attempt,
        world_size=job.world_size,
        arrays=arrays,
        values=encode_values(job.values),
        metadata=job.metadata,
        versions=library_versions(),
        tensorstore={fqn: reader_spec(store.location, job.attempt_key, a) for fqn, a in arrays.items()},
    )


def manifest_entry(p: ArrayPlan, crcs: dict, shards: dict[str, list]) -> ArrayEntry:
    """The manifest entry of a planned array, with each region's crc32c (keyed by (fqn, offsets))
    and where each of its shards lies in the packs (chunk key -> [pack, offset, nbytes])."""
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
        shards=shards,
    )


# -- everyone else's side ------------------------------------------------------------------------


def wait_for_commit(job: PersistJob, store: ObjectStore) -> None:
    """Non-coordinators: the coordinator's decision. Returns once the manifest names this attempt;
    raises CommitError once the coordinator's marker says it never will, or when no decision came
    by the agreed deadline plus ``decision_grace_s``. Polls back off toward ``poll_cap_s``."""
    key, marker = f"{step_dir(job.step)}/{MANIFEST}", failure_key(job.attempt_key, COMMIT_RANK)
    job.deadline = job.deadline or time.time() + job.commit_timeout_s
    give_up = job.deadline + decision_grace_s(job.commit_timeout_s, store.location.scheme)
    delay, cap = 0.002, poll_cap_s(store.location.scheme, job.world_size, job.poll_cap_s)
    unreadable: Exception | None = None
    ask_at = 0.0  # as in wait_for_receipts: the notice at most once per poll cap
    while True:
        try:
            manifest, decision = _read_json(store, key), None
            if manifest is None:
                decision = _read_json(store, marker)
            if manifest is None and decision is None and time.monotonic() >= ask_at:
                decision, ask_at = notice.read(job.attempt_key, "decision"), time.monotonic() + cap
        except Exception as e:  # noqa: BLE001 - a failed read is no decision (the coordinator's may be "committed"): poll again
            manifest = decision = None
            unreadable = e
        if manifest is not None:
            if manifest.get("attempt") != job.attempt:
                raise CommitError(f"step {job.step} was committed by another attempt; this save was discarded")
            return
        if decision is not None:
            raise CommitError(f"step {job.step} not committed: the commit failed: {decision.get('error')}")
        if time.time() > give_up:
            why = f"; the last read failed: {unreadable}" if unreadable is not None else ""
            raise CommitError(
                f"step {job.step} not committed within {job.commit_timeout_s:.0f} s (rank 0 never wrote "
                f"{store.location.url}/{key}){why}; the previous step is intact"
            )
        time.sleep(delay)
        delay = min(delay * 2, cap)


def settle_failure(job: PersistJob, store: ObjectStore, error: BaseException) -> None:
    """This rank's part of the save failed. Returns if the step was committed anyway (a receipt
    whose PUT raised but landed, seen by the coordinator; or, on the coordinator, a manifest
    that already names the attempt); raises ``error`` otherwise. The
    coordinator's own failure is its decision; another rank marks its failure (so the
    coordinator stops waiting for it) and then waits for the decision like everyone else."""
    if job.rank == 0:
        # A writer killed after commit_manifest (during retention, before it reported "ok") left
        # a committed step: the other ranks read the manifest, so "failed" here would contradict
        # them; checked before any failure marker, which a committed attempt must never carry.
        if names_attempt(store, job):
            log.warning(
                "[rank 0] step %d: the writer failed (%s) after the manifest landed: committed", job.step, error
            )
            return
        write_failure(store, job.attempt_key, job.rank, error)
        decide_failed(store, job, error)
        raise error
    write_failure(store, job.attempt_key, job.rank, error)
    try:
        wait_for_commit(job, store)
    except CommitError:
        raise error from None
    log.warning(
        "[rank %d] step %d: this rank's write raised (%s), but the coordinator committed the step",
        job.rank,
        job.step,
        error,
    )
