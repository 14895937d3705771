"""A RAM restore with no persistent step behind it (``recovery/restore.py``): given the caller's
``reinit``, each snapshot lands straight in the state (no fresh memory), and a step not restored
after all is undone by ``reinit`` on every rank it reached; without one, fresh memory first."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram import node_store_dir
from resilient.storage.checkpointer import Checkpointer
from tests.dist import run_world
from tests.recovery.policy import restore_with, snapshot_rank, state, tier
from tests.recovery.ram import workers as ram_workers

pytestmark = pytest.mark.timeout(180)

REINIT = pytest.mark.parametrize("reinit", [True, False], ids=["reinit", "no_reinit"])


def _restore_rank(rank: int, world: int, store_dir: str, ckpt_url: str, run_dir: str, reinit: bool) -> dict[str, Any]:
    """A restarted rank, counting the whole snapshots that land in fresh memory."""
    mapped = ram_workers.count_snapshots_into_fresh_memory(state(0))
    ram = tier(Path(store_dir), rank=rank, world=world)
    try:
        with Checkpointer(ckpt_url) as ckpt:
            result, caller, _ = restore_with(Path(run_dir), ckpt, ram, reinit=reinit)
    finally:
        ram.close()
    assert caller.target_state is not None
    model = caller.target_state["model"]
    return {
        "source": result.source,
        "step": result.step,
        "fresh_memory": len(mapped),
        "found_by_reinit": caller.found_by_reinit,
        "values": {name: sorted(set(t.flatten().tolist())) for name, t in model.items()},
        "train": caller.target_state["train"],
    }


def _snapshot_then_lose_node_1(tmp_path: Path) -> tuple[str, str, str]:
    """Step 4 in RAM on two ranks, no committed step; node 1 (rank 1's own store) is replaced."""
    store, ckpt, run_dir = str(tmp_path / "store"), str(tmp_path / "ckpt"), str(tmp_path / "run")
    run_world(snapshot_rank, 2, store, [4], ckpt, run_dir, timeout_s=90)
    shutil.rmtree(node_store_dir(RamTierConfig(store_dir=store, ranks_per_node=1), os.path.join(store, "run"), 0, 1))
    return store, ckpt, run_dir


@pytest.mark.dist
@REINIT
def test_with_reinit_a_buddy_copy_lands_straight_in_the_state(tmp_path: Path, reinit: bool) -> None:
    store, ckpt, run_dir = _snapshot_then_lose_node_1(tmp_path)
    restored = run_world(_restore_rank, 2, store, ckpt, run_dir, reinit, timeout_s=90)
    assert [(r["source"], r["step"]) for r in restored] == [("own", 4), ("buddy", 4)]
    assert all(r["values"] == {"w": [1004.0], "z": [1004.5]} and r["found_by_reinit"] == [] for r in restored)
    # Rank 1 fetched its buddy's copy: into its state's tensors with a reinit behind it, else into
    # fresh memory first (copied once every rank had its snapshot).
    assert [r["fresh_memory"] for r in restored] == ([0, 0] if reinit else [0, 1])


@pytest.mark.dist
@REINIT
def test_without_a_persistent_step_a_rank_whose_peer_fails_keeps_its_initial_state(
    tmp_path: Path, reinit: bool
) -> None:
    # Rank 1's copy of step 4 that node 0 keeps is corrupt: nothing restores from RAM and, with no
    # committed step, the group starts fresh. Rank 0, whose own snapshot was fine, must not train
    # from step 4 while rank 1 trains from the initial state.
    store, ckpt, run_dir = _snapshot_then_lose_node_1(tmp_path)
    assert ram_workers.corrupt_kept_copies(store, os.path.join(store, "run"), 1, node=0) == [4]
    restored = run_world(_restore_rank, 2, store, ckpt, run_dir, reinit, timeout_s=90)
    assert [(r["source"], r["step"]) for r in restored] == [("fresh", 0), ("fresh", 0)]
    assert all(r["values"] == {"w": [-1.0], "z": [-0.5]} for r in restored)
    assert all(r["train"] == {"step": 0, "tokens_seen": 0} for r in restored)
    # With a reinit, step 4 landed in both ranks' tensors (rank 1's copy up to its first bad
    # byte's tensor and past it) and each put the initial state back, once; without one nothing
    # landed there.
    landed = [{"w": 1004.0, "z": 1004.5}]
    assert [r["found_by_reinit"] for r in restored] == ([landed, landed] if reinit else [[], []])


def _put_back_rank(rank: int, world: int, touched_ranks: list[int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from resilient.recovery.restore import _put_back_initial

    calls: list[float] = []

    def reinit() -> None:  # as a tensor-parallel model's build: a collective of its own
        total = torch.ones(1)
        dist.all_reduce(total)
        calls.append(total.item())

    _put_back_initial(reinit, rank in touched_ranks)
    return {"calls": calls}


@pytest.mark.dist
@pytest.mark.parametrize("touched_ranks", [[0], [1], [0, 1], []], ids=["rank0", "rank1", "both", "none"])
def test_the_initial_state_goes_back_on_every_rank_when_any_was_written_into(touched_ranks: list[int]) -> None:
    # One rank's own snapshot landed while its peer's fetch failed before a byte did: the reinit
    # runs everywhere (its collectives need every rank), or nowhere when nothing landed.
    results = run_world(_put_back_rank, 2, touched_ranks, timeout_s=60)
    assert [r["calls"] for r in results] == ([[2.0], [2.0]] if touched_ranks else [[], []])
