"""``node_away``: a simulated node gone across a RAM restore, then back with the snapshots it held.

At the fault's step the group's ranks are frozen (SIGSTOP, so no store changes meanwhile), the
node's RAM store is set aside, the other nodes' copies of the node's newest snapshot are dropped
(it vanished before that snapshot reached its buddy) and the node's ranks are killed: the group
restores from RAM at an older step, a branch, and retrains the steps after it. Once the group has
committed the step after the node's newest snapshot again, the node comes back: its ranks are
frozen and killed again and its store replaced by the one set aside. The restore that follows
meets the node's own snapshot of a step the others retrained: it must restore the retrained one
(the invariant ``ram_restores_on_branch``), never the node's, which belongs to the abandoned branch.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import time
from typing import TYPE_CHECKING

from resilient.chaos.job import job_node_store_dir
from resilient.chaos.procs import alive_rank_pid, wait_stopped

if TYPE_CHECKING:
    from resilient.chaos.inject import FaultRecord, InjectContext

ASIDE = ".away"
"""Suffix of the node's store while it is away."""
RETURN_TIMEOUT_S = 180.0
"""Longest wait, after the node left, for the group to retrain past the node's newest snapshot."""
STOP_TIMEOUT_S = 10.0
_STEP_FILE = re.compile(r"step-(\d+)\.json$")


def _node_ranks(ctx: InjectContext, node: int) -> list[int]:
    per_node = ctx.job.job.ranks_per_node
    return list(range(node * per_node, (node + 1) * per_node))


def _steps(directory: str) -> list[int]:
    found = (_STEP_FILE.search(p) for p in glob.glob(os.path.join(directory, "step-*.json")))
    return sorted(int(m.group(1)) for m in found if m)


def _stop(pids: list[int]) -> list[int]:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    return wait_stopped(pids, STOP_TIMEOUT_S)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def start(record: FaultRecord, ctx: InjectContext) -> bool:
    """The node leaves; False while a rank of the group is not alive (retried on the next poll)."""
    spec = record.spec
    pids = {r: alive_rank_pid(ctx.job.run_dir, spec.group, r) for r in range(ctx.job.job.nproc_per_group)}
    if any(p is None for p in pids.values()):
        return False
    away = _node_ranks(ctx, spec.node)
    store = job_node_store_dir(ctx.config, ctx.job.run_dir, spec.group, spec.node)
    record.extra["store"] = store
    stuck = _stop([p for p in pids.values() if p is not None])
    try:
        newest = max((s for r in away for s in _steps(os.path.join(store, "own", f"rank{r}"))), default=None)
        if newest is None:
            record.state = "failed"
            record.note = f"node {spec.node} holds no RAM snapshot in {store}: nothing to set aside, nothing killed"
            return True
        os.rename(store, store + ASIDE)
        dropped = []
        for path in glob.glob(os.path.join(os.path.dirname(store), "*", "buddy", "rank*", f"step-{newest:09d}.json")):
            if int(os.path.basename(os.path.dirname(path))[4:]) in away:
                os.remove(path)
                dropped.append(os.path.relpath(path, os.path.dirname(store)))
        record.extra.update(away_step=newest, dropped_copies=sorted(dropped), not_stopped=stuck)
        _kill(record, ctx, {r: pids[r] for r in away})
    finally:
        # Every frozen rank that was not killed runs on, the node's own included when the fault
        # failed before killing them: a rank left stopped hangs its group in collectives.
        killed = {k["pid"] for k in record.killed}
        _signal([p for p in pids.values() if p is not None and p not in killed], signal.SIGCONT)
    record.extra["_return_by"] = time.time() + RETURN_TIMEOUT_S
    record.state = "injected"
    return True


def _kill(record: FaultRecord, ctx: InjectContext, pids: dict[int, int | None]) -> None:
    group = record.spec.group
    for rank, pid in pids.items():
        if pid is not None:
            _signal([pid], signal.SIGKILL)
            record.killed.append({"group": group, "rank": rank, "pid": pid})
    record.rejoin[group] = max(record.rejoin.get(group, 0), ctx.attempts.get(group, 0) + 1)


def _retrained(record: FaultRecord, ctx: InjectContext) -> bool:
    """The group rejoined and committed the step after the node's newest snapshot again."""
    group, target = record.spec.group, record.extra["away_step"] + 1
    rejoined = False
    for e in ctx.job.events.records:
        if e.get("group") != group:
            continue
        if e.get("event") == "joining" and e.get("attempt", 0) >= record.rejoin[group]:
            rejoined = True
        elif rejoined and e.get("event") == "step" and e.get("committed") and e.get("step", 0) >= target:
            return True
    return False


def follow(record: FaultRecord, ctx: InjectContext) -> None:
    """The node comes back once the group retrained past its newest snapshot."""
    spec = record.spec
    if not _retrained(record, ctx):
        if time.time() >= record.extra["_return_by"]:
            put_back(record)
            record.state = "failed"
            step = record.extra["away_step"] + 1
            record.note = f"the group did not commit step {step} again within {RETURN_TIMEOUT_S:.0f} s"
        return
    away = _node_ranks(ctx, spec.node)
    pids = {r: alive_rank_pid(ctx.job.run_dir, spec.group, r) for r in away}
    if any(p is None for p in pids.values()):
        return
    record.extra["not_stopped_at_return"] = _stop([p for p in pids.values() if p is not None])
    try:
        put_back(record)
    finally:
        _kill(record, ctx, pids)
    record.extra["returned_at"] = time.time()
    record.state = "done"


def put_back(record: FaultRecord) -> None:
    """The node's own store again: the one set aside, in place of its replacement's."""
    store = record.extra.get("store", "")
    if store and os.path.isdir(store + ASIDE):
        shutil.rmtree(store, ignore_errors=True)
        os.rename(store + ASIDE, store)
