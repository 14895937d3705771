"""The demo's RAM-tier phase: lose a node, restore from its buddy's RAM, read nothing from storage.

2 ranks (dp_shard=2, tp=1), each its own simulated node (``recovery.ranks_per_node=1``), a RAM
snapshot every 2 steps, a persistent checkpoint only at the end. At step ``KILL_STEP`` the demo
stops rank 1, wipes its node's store (the node is gone, with its memory) and SIGKILLs it; torchrun
restarts the group; rank 0 restores from its own node's store, rank 1 from the copy its buddy
(rank 0's node) holds. The summary prints each rank's ``restore`` event; the demo exits non-zero
if the restore read storage or did not come from RAM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from resilient.recovery.ram import node_store_dir
from resilient.runfiles import (
    EVENTS_FILE,
    METRICS_FILE,
    RAM_FILE,
    events_path,
    group_file,
    read_events,
    read_jsonl_by_step,
    read_pid,
)
from resilient.trainer.config import load_config

STEPS, KILL_STEP = 30, 10
TIMEOUT_S = 300.0


def _overrides(run_dir: str) -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"run.steps={STEPS}",
        "parallel.tp=1",
        "checkpoint.memory_every=2",
        "checkpoint.persist_every=1000",
        "recovery.ranks_per_node=1",
        f"recovery.store_dir={run_dir}/ram",
        "run.log_every=10",
    ]


def _wait_for_step(run_dir: str, step: int, proc: subprocess.Popen) -> None:
    path = group_file(run_dir, METRICS_FILE, 0)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"[demo] the RAM-tier run ended (exit code {proc.returncode}) before step {step}")
        if os.path.exists(path) and max(read_jsonl_by_step(path) or [0]) >= step:
            return
        time.sleep(0.05)
    sys.exit(f"[demo] the RAM-tier run did not reach step {step} in {TIMEOUT_S:.0f} s")


def _lose_node(run_dir: str, recipe: str, rank: int) -> float:
    """Wipe ``rank``'s node store and SIGKILL it; returns when (unix time, as events record it)."""
    config = load_config(recipe, _overrides(run_dir))
    lost_at = time.time()
    pid = read_pid(run_dir, 0, rank)
    if pid is None:
        sys.exit(f"[demo] no pid file for rank {rank} under {run_dir}/pids")
    os.kill(pid, signal.SIGSTOP)  # stopped, it cannot write while its node's memory goes away
    shutil.rmtree(node_store_dir(config.recovery, run_dir, 0, rank))
    os.kill(pid, signal.SIGKILL)
    print(
        f"[demo] node {rank} lost at step >= {KILL_STEP}: rank {rank} (pid {pid}) SIGKILLed, its RAM store wiped",
        flush=True,
    )
    return lost_at


def run_ram_phase(recipe: str, run_dir: str) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "resilient.tools.train",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "--config",
        recipe,
        *[a for o in _overrides(run_dir) for a in ("--set", o)],
    ]
    proc = subprocess.Popen(command, start_new_session=True)
    try:
        _wait_for_step(run_dir, KILL_STEP, proc)
        lost_at = _lose_node(run_dir, recipe, rank=1)
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        sys.exit(f"[demo] the RAM-tier run failed with exit code {code}")
    _summary(run_dir, lost_at)


_WHERE = {
    "own": "its own node's RAM",
    "buddy": "its buddy node's copy, in RAM",
    "persistent": "persistent storage",
    "peer": "a live replica group",
    "fresh": "nothing: a fresh start",
}


def restores_after(run_dir: str, since: float) -> dict[int, dict]:
    """Each rank's last ``restore`` event written after ``since``: the restart's, whatever the
    first start (or an earlier restart) recorded."""
    latest: dict[int, dict] = {}
    for e in read_events(run_dir):
        if e["event"] == "restore" and e["t"] >= since:
            latest[e["rank"]] = e
    return dict(sorted(latest.items()))


def _summary(run_dir: str, lost_at: float) -> None:
    restores = restores_after(run_dir, lost_at)
    print(f"\n[ram] restore after losing node 1 (each rank's own restore event, from {EVENTS_FILE}):")
    for rank, e in restores.items():
        print(
            f"  rank {rank}: step {e['step']} from {e['source']} ({_WHERE.get(e['source'], e['source'])}), "
            f"{e['bytes'] / 2**20:.2f} MiB in {e['seconds']:.3f} s, storage reads: {e['storage_reads']}"
        )
    sources = {rank: e["source"] for rank, e in restores.items()}
    if sources != {0: "own", 1: "buddy"} or any(e["storage_reads"] for e in restores.values()):
        sys.exit(f"[demo] expected rank 0 from its own store and rank 1 from its buddy, no storage reads: {sources}")
    metrics = read_jsonl_by_step(group_file(run_dir, METRICS_FILE, 0))
    print(
        f"[ram] resumed at step {restores[0]['step']} (the newest snapshot every rank had in RAM), trained to "
        f"step {max(metrics)}"
    )
    print(f"[files] {events_path(run_dir)}, {group_file(run_dir, RAM_FILE, 0)}")
