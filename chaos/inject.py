"""Injecting one fault into a running job: kills by pid, SIGSTOP/SIGCONT, armed fault points,
flipped bytes, S3 proxy windows, slow spans (a SIGSTOP/SIGCONT duty cycle, or a sleep in the rank).

Each fault is a small state machine driven by the harness's poll loop (``advance``): pending until
its step (or time) comes, then injected, then done; faults that wait for something (a marker file
written by a paused rank, the end of a SIGSTOP) stay ``injected`` meanwhile, so several faults can
be in flight and the loop keeps watching the job.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilient.chaos import away
from resilient.chaos.hooks import arm_path, corrupt_path, marker_dir, slow_path, write_atomic
from resilient.chaos.job import JobProcess, job_node_store_dir
from resilient.chaos.procs import alive_rank_pid, wait_stopped
from resilient.chaos.s3_proxy import FaultProxy
from resilient.chaos.scenario import FAULT_KINDS, FaultSpec
from resilient.chaos.throttle import DutyCycle
from resilient.runfiles import lighthouse_pid_path

MARKER_TIMEOUT_S = 120.0
"""Longest wait for an armed fault point to be reached (a persist or a heal)."""
TARGET_TIMEOUT_S = 90.0
"""Longest wait for a target rank to be alive (it may be restarting from an earlier fault)."""
STOP_TIMEOUT_S = 10.0
"""Longest wait for a SIGSTOPped node's threads to stop before its store is wiped anyway (reported)."""


@dataclass(slots=True)
class FaultRecord:
    spec: FaultSpec
    state: str = "pending"  # pending | injected | done | failed
    t_due: float | None = None
    t_injected: float | None = None
    at_step: int | None = None
    """The job's step (highest committed) when the fault hit."""
    killed: list[dict[str, Any]] = field(default_factory=list)
    rejoin: dict[int, int] = field(default_factory=dict)
    """group -> torchrun attempt the group must reach again (its recovery)."""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    _marker: str = ""
    _until: float = 0.0
    _armed: bool = False
    _throttle: DutyCycle | None = None


@dataclass(slots=True)
class InjectContext:
    job: JobProcess
    config: Any
    """The job's TrainConfig."""
    proxy: FaultProxy | None
    job_step: int = 0
    attempts: dict[int, int] = field(default_factory=dict)
    """group -> highest torchrun attempt seen joining."""


def _group_ranks(ctx: InjectContext, spec: FaultSpec) -> list[int]:
    nproc = ctx.job.job.nproc_per_group
    if spec.kind == "kill_group":
        return list(range(nproc))
    if spec.kind == "kill_node":
        per_node = ctx.job.job.ranks_per_node
        return list(range(spec.node * per_node, (spec.node + 1) * per_node))
    return [spec.rank]


def _kill(record: FaultRecord, ctx: InjectContext, group: int, ranks: list[int]) -> bool:
    """SIGKILL the ranks (all alive first, else wait); True once done."""
    pids = {r: alive_rank_pid(ctx.job.run_dir, group, r) for r in ranks}
    if any(p is None for p in pids.values()):
        return False
    for rank, pid in pids.items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        record.killed.append({"group": group, "rank": rank, "pid": pid})
    record.rejoin[group] = max(record.rejoin.get(group, 0), ctx.attempts.get(group, 0) + 1)
    return True


def _committed_attempt(root: str, step: int) -> str:
    """The attempt a step's manifest names (a failed or orphan attempt beside it is never read, so
    corrupting it would test nothing); "attempt-*" when the manifest cannot say."""
    from resilient.storage.objects import open_store
    from resilient.storage.retention import DamagedManifest, committed_attempt
    from resilient.storage.url import parse_url

    try:
        attempt = committed_attempt(open_store(parse_url(root)), step)
    except DamagedManifest:
        return "attempt-*"
    return attempt if attempt is not None and attempt.startswith("attempt-") else "attempt-*"


def _flip_byte(ctx: InjectContext, record: FaultRecord) -> None:
    root = ctx.config.checkpoint.url
    steps = sorted(
        int(os.path.basename(d)[5:])
        for d in glob.glob(os.path.join(root, "step-*"))
        if os.path.exists(os.path.join(d, "manifest.json"))
    )
    if not steps:
        record.note = f"no committed step under {root} yet: nothing corrupted"
        return
    step = steps[0] if record.spec.target == "oldest" else steps[-1]
    attempt = _committed_attempt(root, step)
    packed = _largest_packed_shard(root, step)
    if packed is not None:  # format v3: the middle of a shard's own bytes, never a ZIP header
        path, offset = packed
        _xor_byte(path, offset)
        record.extra.update(step=step, file=os.path.relpath(path, root), offset=offset)
        return
    chunks = sorted(  # shard objects of the committed attempt: every file but the JSON (zarr.json, receipts)
        (os.path.getsize(p), p)
        for p in glob.glob(os.path.join(root, f"step-{step:09d}", attempt, "**"), recursive=True)
        if os.path.isfile(p) and not p.endswith(".json")
    )
    if not chunks:
        record.note = f"step {step} has no chunk file"
        return
    size, path = chunks[-1]  # the largest: its middle is tensor data, not the shard index
    _xor_byte(path, size // 2)
    record.extra.update(step=step, file=os.path.relpath(path, root), offset=size // 2)


def _largest_packed_shard(root: str, step: int) -> tuple[str, int] | None:
    """(pack path, the offset of the middle of its largest shard) from a v3 manifest; None for
    older layouts, whose shards are files of their own."""
    with open(os.path.join(root, f"step-{step:09d}", "manifest.json")) as f:
        manifest = json.load(f)
    shards = [ref for entry in manifest.get("arrays", {}).values() for ref in (entry.get("shards") or {}).values()]
    if not shards:
        return None
    pack, offset, nbytes = max(shards, key=lambda ref: ref[2])
    return os.path.join(root, f"step-{step:09d}", manifest["attempt"], pack), offset + nbytes // 2


def _xor_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _arm(ctx: InjectContext, groups: list[int], spec: str) -> None:
    for group in groups:
        shutil.rmtree(marker_dir(ctx.job.chaos_dir, group), ignore_errors=True)
        write_atomic(arm_path(ctx.job.chaos_dir, group), spec)


def _disarm(ctx: InjectContext, groups: list[int]) -> None:
    for group in groups:
        with contextlib.suppress(FileNotFoundError):
            os.remove(arm_path(ctx.job.chaos_dir, group))


def _start_kill(record: FaultRecord, ctx: InjectContext) -> bool:
    if not _kill(record, ctx, record.spec.group, _group_ranks(ctx, record.spec)):
        return False
    record.state = "done"
    return True


def _start_kill_node(record: FaultRecord, ctx: InjectContext) -> bool:
    """Lose a node with its RAM store: freeze its ranks (SIGSTOP, so none writes while the store goes),
    wipe the store, then SIGKILL them. No store to wipe: the fault fails and kills nothing."""
    spec = record.spec
    ranks = _group_ranks(ctx, spec)
    pids = {r: alive_rank_pid(ctx.job.run_dir, spec.group, r) for r in ranks}
    if any(p is None for p in pids.values()):
        return False
    store = job_node_store_dir(ctx.config, ctx.job.run_dir, spec.group, spec.node)
    record.extra["store"] = store
    if not os.path.isdir(store):
        record.state = "failed"
        record.note = (
            f"node {spec.node}'s RAM store {store} does not exist (checkpoint.memory_every="
            f"{ctx.config.checkpoint.memory_every}): nothing to wipe, nothing killed"
        )
        return True
    try:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        not_stopped = wait_stopped(list(pids.values()), STOP_TIMEOUT_S)
        if not_stopped:
            record.extra["not_stopped_before_wipe"] = not_stopped
        shutil.rmtree(store)
        record.extra["store_wiped"] = not os.path.exists(store)
    finally:
        for rank, pid in pids.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            record.killed.append({"group": spec.group, "rank": rank, "pid": pid})
        record.rejoin[spec.group] = max(record.rejoin.get(spec.group, 0), ctx.attempts.get(spec.group, 0) + 1)
    record.state = "done"
    return True


def _start_stop_rank(record: FaultRecord, ctx: InjectContext) -> bool:
    spec = record.spec
    pid = alive_rank_pid(ctx.job.run_dir, spec.group, spec.rank)
    if pid is None:
        return False
    os.kill(pid, signal.SIGSTOP)
    record.killed.append({"group": spec.group, "rank": spec.rank, "pid": pid, "signal": "SIGSTOP"})
    record._until = time.time() + spec.seconds
    record.state = "injected"
    return True


def _start_kill_during_persist(record: FaultRecord, ctx: InjectContext) -> bool:
    spec = record.spec
    spec_text = f"persist.first_region_issued=pause:{spec.seconds}@rank{spec.rank}"
    _arm(ctx, list(range(ctx.job.job.replica_groups)), spec_text)
    record._marker = f"persist.first_region_issued.rank{spec.rank}"
    record._until = time.time() + MARKER_TIMEOUT_S
    record.state = "injected"
    return True


def _start_kill_during_heal(record: FaultRecord, ctx: InjectContext) -> bool:
    spec = record.spec
    attempt = ctx.attempts.get(spec.group, 0) + 1
    _arm(ctx, [spec.group], f"replica.heal_load.attempt{attempt}=pause:{spec.seconds}@rank{spec.rank}")
    if not _kill(record, ctx, spec.group, [spec.rank]):
        _disarm(ctx, [spec.group])
        return False
    record._marker = f"replica.heal_load.attempt{attempt}.rank{spec.rank}"
    record._until = time.time() + MARKER_TIMEOUT_S
    record.state = "injected"
    return True


def _start_corrupt_chunk(record: FaultRecord, ctx: InjectContext) -> bool:
    _flip_byte(ctx, record)
    record.state = "done"
    return True


def _start_s3_window(record: FaultRecord, ctx: InjectContext) -> bool:
    spec = record.spec
    assert ctx.proxy is not None, "s3_* faults need job.storage = 's3' (checked by the scenario parser)"
    window = ctx.proxy.add_window(
        spec.kind[3:], spec.seconds, rate=spec.rate, delay_s=spec.delay_s, keys=spec.keys, drops=spec.drops
    )
    record.extra["window"] = {"start": window.start, "end": window.end}
    record.state = "done"
    return True


def _start_kill_lighthouse(record: FaultRecord, ctx: InjectContext) -> bool:
    with open(lighthouse_pid_path(ctx.job.run_dir)) as f:
        pid = int(f.read().strip())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    record.killed.append({"lighthouse": True, "pid": pid})
    record.state = "done"
    return True


def _start_corrupt_replica(record: FaultRecord, ctx: InjectContext) -> bool:
    write_atomic(corrupt_path(ctx.job.chaos_dir, record.spec.group), "1")
    record.state = "done"
    return True


def _arm_slow_rank(record: FaultRecord, ctx: InjectContext, first_step: int) -> None:
    """Add the fault's span to ``arm/slow-group<G>`` (the hook re-reads it after every step)."""
    spec = record.spec
    path = slow_path(ctx.job.chaos_dir, spec.group)
    try:
        with open(path) as f:
            spans = json.load(f)
    except FileNotFoundError:
        spans = []
    span = {
        "fault": spec.index,
        "rank": spec.rank,
        "first_step": first_step,
        "last_step": first_step + spec.steps - 1,
        "delay_s": spec.delay_s,
    }
    write_atomic(path, json.dumps([s for s in spans if s["fault"] != spec.index] + [span]))
    record.extra["slow_steps"] = [span["first_step"], span["last_step"]]
    record._armed = True


def _throttle_slow_rank(record: FaultRecord, ctx: InjectContext, first_step: int) -> bool:
    """Start holding the rank stopped ``duty`` of the time (from outside its process); False while
    the rank is not alive."""
    spec = record.spec
    pid = alive_rank_pid(ctx.job.run_dir, spec.group, spec.rank)
    if pid is None:
        return False
    record._throttle = DutyCycle(pid, spec.duty, seed=spec.index).start()
    record.extra["slow_steps"] = [first_step, first_step + spec.steps - 1]
    record.extra["pid"] = pid
    record._armed = True
    return True


def _prearm_slow_rank(record: FaultRecord, ctx: InjectContext) -> None:
    # The harness sees a step only after it committed, so arming at the fault's step would miss the
    # first steps of the span; the span is written as soon as its first step is known, and the hook
    # applies it by step number. A throttle from outside starts once the step before the span
    # committed (its first stops may still land in that step's tail).
    spec = record.spec
    if spec.at_step is None:
        return
    if not spec.duty:
        _arm_slow_rank(record, ctx, spec.at_step)
    elif ctx.job_step >= spec.at_step - 1:
        _throttle_slow_rank(record, ctx, spec.at_step)


def _start_slow_rank(record: FaultRecord, ctx: InjectContext) -> bool:
    if not record.spec.duty:
        if not record._armed:  # at_time_s: the span starts at the next step
            _arm_slow_rank(record, ctx, ctx.job_step + 1)
        record.state = "done"
        return True
    if not record._armed and not _throttle_slow_rank(record, ctx, ctx.job_step + 1):
        return False
    record.state = "injected"  # until the span's last step committed (``_follow``)
    return True


def _end_throttle(record: FaultRecord) -> None:
    throttle = record._throttle
    if throttle is None:
        return
    throttle.stop()
    record.extra.update(stopped_s=round(throttle.stopped_s, 3), duty_measured=round(throttle.share(), 3))
    record._throttle = None


_PREARMS: dict[str, Callable[[FaultRecord, InjectContext], None]] = {"slow_rank": _prearm_slow_rank}
"""kind -> what to arm while the fault is still pending (once, at the harness's first poll)."""

_STARTERS: dict[str, Callable[[FaultRecord, InjectContext], bool]] = {
    "kill_rank": _start_kill,
    "kill_group": _start_kill,
    "kill_node": _start_kill_node,
    "node_away": away.start,
    "stop_rank": _start_stop_rank,
    "kill_during_persist": _start_kill_during_persist,
    "kill_during_heal": _start_kill_during_heal,
    "corrupt_chunk": _start_corrupt_chunk,
    "s3_errors": _start_s3_window,
    "s3_resets": _start_s3_window,
    "s3_latency": _start_s3_window,
    "s3_ambiguous": _start_s3_window,
    "kill_lighthouse": _start_kill_lighthouse,
    "corrupt_replica": _start_corrupt_replica,
    "slow_rank": _start_slow_rank,
}
"""kind -> its injection: True when injected (or done, or failed for good), False to retry on the next poll."""
assert set(_STARTERS) == set(FAULT_KINDS), "every fault kind needs an injection"


def _start(record: FaultRecord, ctx: InjectContext) -> bool:
    """Inject; True when injected (or done), False to try again on the next poll."""
    if not _STARTERS[record.spec.kind](record, ctx):
        return False
    if record.state == "failed":
        return True  # nothing was done: no time or step to attribute
    record.t_injected = time.time()
    record.at_step = ctx.job_step
    return True


def _follow(record: FaultRecord, ctx: InjectContext) -> None:
    """Advance a fault that is waiting for its marker or for the end of its SIGSTOP."""
    spec, now = record.spec, time.time()
    if spec.kind == "node_away":
        away.follow(record, ctx)
        return
    if spec.kind == "slow_rank":
        if ctx.job_step >= record.extra["slow_steps"][1]:
            _end_throttle(record)
            record.state = "done"
        return
    if spec.kind == "stop_rank":
        if now >= record._until:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.killed[0]["pid"], signal.SIGCONT)
            record.extra["resumed_t"] = now
            record.state = "done"
        return
    groups = list(range(ctx.job.job.replica_groups)) if spec.kind == "kill_during_persist" else [spec.group]
    for group in groups:
        path = os.path.join(marker_dir(ctx.job.chaos_dir, group), record._marker)
        try:
            with open(path) as f:
                pid = int(f.read().strip())
        except (FileNotFoundError, ValueError):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _disarm(ctx, groups)
        record.killed.append({"group": group, "rank": spec.rank, "pid": pid, "at": record._marker})
        # The heal's restart is one attempt past the first kill's; the next one must rejoin.
        previous = record.rejoin.get(group, 0)
        record.rejoin[group] = previous + 1 if previous else ctx.attempts.get(group, 0) + 1
        if spec.kind == "kill_during_persist":
            record.t_injected, record.at_step = now, ctx.job_step
        record.extra["second_kill_t" if spec.kind == "kill_during_heal" else "kill_t"] = now
        record.state = "done"
        return
    if now >= record._until:
        _disarm(ctx, groups)
        record.state = "failed"
        record.note = f"{record._marker} was not reached within {MARKER_TIMEOUT_S:.0f} s: nothing killed there"


def advance(record: FaultRecord, ctx: InjectContext, t_first_commit: float | None) -> None:
    """One poll of one fault."""
    spec = record.spec
    if record.state == "pending":
        if spec.kind in _PREARMS and not record._armed:
            _PREARMS[spec.kind](record, ctx)
        due = (spec.at_step is not None and ctx.job_step >= spec.at_step) or (
            spec.at_time_s is not None and t_first_commit is not None and time.time() - t_first_commit >= spec.at_time_s
        )
        if not due:
            return
        record.t_due = record.t_due or time.time()
        if not _start(record, ctx) and time.time() - record.t_due > TARGET_TIMEOUT_S:
            record.state = "failed"
            record.note = f"target not alive within {TARGET_TIMEOUT_S:.0f} s of the fault's step"
    elif record.state == "injected":
        _follow(record, ctx)


def release(record: FaultRecord) -> None:
    """Undo what must not outlive the harness (a SIGSTOPped rank, a duty cycle)."""
    if record.spec.kind == "slow_rank" and record._throttle is not None:
        _end_throttle(record)
        record.state = "done"
    if record.spec.kind == "node_away" and record.state == "injected":
        away.put_back(record)
    if record.spec.kind == "stop_rank" and record.state == "injected":
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.killed[0]["pid"], signal.SIGCONT)
        record.state = "done"
