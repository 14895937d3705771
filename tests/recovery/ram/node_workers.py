"""Rank functions of the node-identity tests (module level: spawned processes import them).

Each rank plays a machine: ``RESILIENT_NODE_ID`` is that machine's name and its store lives under
``<base>/<machine>`` (a real machine's /dev/shm is its own), so a rank that moves to another
machine between incarnations finds only what that machine holds.
"""

from __future__ import annotations

import os

import torch

from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram.tier import RamTier
from resilient.recovery.timeline import Timeline
from tests.recovery.ram.workers import empty_state, state_of


def machine_tier(rank: int, world: int, base: str, machines: list[str]) -> RamTier:
    os.environ["RESILIENT_NODE_ID"] = machines[rank]
    store_dir = os.path.join(base, machines[rank])
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=1, replication_timeout_s=30.0)
    ram = RamTier(
        config, keep=2, run_dir=os.path.join(base, "run"), group=0, rank=rank, world_size=world, fingerprint={"tp": 1}
    )
    ram.start()
    return ram


def snapshot_on(rank: int, world: int, base: str, machines: list[str], steps: list[int], timeline: str = "") -> dict:
    """Snapshot each step on machine ``machines[rank]`` (tagged ``timeline`` of run "run", if
    given); report where the node store is."""
    ram = machine_tier(rank, world, base, machines)
    if timeline:
        ram.timeline = Timeline(run_id="run", incarnation=int(timeline.split("-")[0]), timeline=timeline)
    for step in steps:
        ram.snapshot(step, state_of(rank, step))
        ram.wait(30)
    torch.distributed.barrier()  # every copy landed before any rank stops its server (workers.take_snapshots)
    ram.close()
    replicated = [r["replication"]["outcome"] for r in ram.stats.records]
    return {"node_dir": ram.node_dir, "node_id": ram.node_id, "buddy": ram.pairing.buddy_of(rank), "copies": replicated}


def restore_on(rank: int, world: int, base: str, machines: list[str]) -> dict:
    """A restarted rank on machine ``machines[rank]``: restore into an empty state."""
    ram = machine_tier(rank, world, base, machines)
    state = empty_state()
    outcome = ram.restore(state, None)
    ram.close()
    return {
        "step": outcome.step,
        "source": outcome.source,
        "sources": outcome.sources,
        "excluded": outcome.excluded,
        "w": float(state["model"]["w"][0, 0]),
        "b": float(state["model"]["b"][0]),
        "train": state["train"],
    }


def start_on(rank: int, world: int, base: str, machines: list[str]) -> dict:
    """Start a tier on ``machines[rank]``; report the error every rank should get."""
    try:
        machine_tier(rank, world, base, machines).close()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}
