"""Helpers of the restore-policy tests (``recovery/restore.py``): a tiny training state, the
caller's side of ``restore``, and the tiers filled the way a trainer fills them. Module level:
spawned ranks import them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from resilient.dist import barrier
from resilient.recovery.ram import RamTier
from resilient.recovery.restore import RestoreResult, restore
from resilient.runfiles import read_events
from resilient.storage.checkpointer import Checkpointer
from tests.recovery.ram import workers as ram_workers

LAYOUT = "dp_shard=1 x tp=1"


def state(step: int, value: float | None = None) -> dict[str, Any]:
    """Two tensors (a load can fail after writing the first) and the train counters of ``step``."""
    v = float(step if value is None else value)
    return {
        "model": {"w": torch.full((8, 4), v), "z": torch.full((4, 4), v + 0.5)},
        "train": {"step": step, "tokens_seen": 10 * step},
    }


class Caller:
    """The caller's side: builds the state to load into, and applies what was loaded."""

    def __init__(self) -> None:
        self.built = 0
        self.applied: dict[str, Any] | None = None
        self.target_state: dict[str, Any] | None = None
        self.found_by_reinit: list[dict[str, float]] = []
        """Each ``reinit`` call: the last value of each model tensor it found (what had landed)."""

    def target(self) -> dict[str, Any]:
        self.built += 1
        self.target_state = state(0, value=-1.0)
        return self.target_state

    def apply(self, loaded: dict[str, Any]) -> None:
        self.applied = loaded

    def reinit(self) -> None:
        """Put the initial state back into the target's tensors, in place, as a trainer does into
        its live model and optimizer (``trainer.build.reinitialize``)."""
        assert self.target_state is not None
        model = self.target_state["model"]
        self.found_by_reinit.append({name: float(t.flatten()[-1]) for name, t in model.items()})
        for name, initial in state(0, value=-1.0)["model"].items():
            model[name].copy_(initial)


def restore_with(
    run_dir: Path, ckpt: Checkpointer, ram: RamTier | None = None, *, reinit: bool = False, **kwargs: Any
) -> tuple[RestoreResult, Caller, list[str]]:
    """``restore`` for a ``Caller`` (with its ``reinit`` when asked); the lines it says."""
    caller, said = Caller(), []
    result = restore(
        caller.target,
        caller.apply,
        checkpointer=ckpt,
        ram=ram,
        run_dir=str(run_dir),
        say=said.append,
        layout=LAYOUT,
        reinit=caller.reinit if reinit else None,
        **kwargs,
    )
    return result, caller, said


def snapshot_rank(rank: int, world: int, store_dir: str, steps: list[int], ckpt_url: str, run_dir: str) -> None:
    """A first run's rank on ``world`` gloo ranks: starts the run's timeline and takes RAM
    snapshots of ``steps``, each copied to its buddy."""
    ram = tier(Path(store_dir), rank=rank, world=world)
    try:
        with Checkpointer(ckpt_url) as ckpt:
            start_run(Path(run_dir), ckpt, ram)
        snapshot(ram, *steps)
        # As Trainer.finish does: every copy has reached its buddy before any rank closes its
        # channel (a rank closing first breaks the pipe of a peer still sending to it).
        ram.wait(60.0)
        barrier()
    finally:
        ram.close()


def start_run(run_dir: Path, ckpt: Checkpointer, ram: RamTier | None) -> None:
    """As a trainer's first start does (here with resume off: no event): the run's first timeline,
    which the snapshots taken next carry."""
    restore(lambda: {}, lambda loaded: None, checkpointer=ckpt, ram=ram, run_dir=str(run_dir), resume=False)


def save(ckpt: Checkpointer, *steps: int) -> None:
    for step in steps:
        ckpt.save(step, state(step)).wait()


def tier(store_dir: Path, *, rank: int = 0, world: int = 1) -> RamTier:
    return ram_workers.tier(rank, world, str(store_dir))


def snapshot(ram: RamTier, *steps: int) -> None:
    """RAM snapshots of ``steps``, valued 1000 + step (told apart from the checkpoints' values)."""
    for step in steps:
        assert ram.snapshot(step, state(step, value=1000.0 + step))
        ram.wait(30)


def events(run_dir: Path, kind: str = "restore") -> list[dict[str, Any]]:
    """The ``kind`` events of ``run_dir``, without their time."""
    return [{k: v for k, v in e.items() if k != "t"} for e in read_events(str(run_dir)) if e["event"] == kind]
