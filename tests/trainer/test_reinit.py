"""The trainer's ``reinit`` (``trainer.build.reinitialize``): after a RAM restore wrote a step into
the live model and optimizer and no step was restored after all, the fresh start must train from
exactly the state a fresh build trains from, on every layout (FSDP shards, pipeline stages)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_world

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
LAYOUTS = {
    "dp_shard2": ("parallel.pp=1", "parallel.dp_shard=2", "parallel.tp=1"),
    "pp2": ("parallel.pp=2", "parallel.dp_shard=1", "parallel.tp=1", "parallel.pp_microbatches=2"),
}


def _trainer(run_dir: str, layout: tuple[str, ...]) -> Any:
    from resilient.trainer.config import load_config
    from resilient.trainer.train import build_trainer

    overrides = [f"run.dir={run_dir}", *layout, "data.num_workers=0"]  # rows built here: ranks are daemons
    return build_trainer(load_config(TINY, overrides), torch.device("cpu"))


def _tensors(trainer: Any) -> dict[str, torch.Tensor]:
    """This rank's own bytes of every tensor of the state a restore targets (``capture_state``)."""
    from resilient.recovery.snapshot_format import local_tensors
    from resilient.state import flatten_state
    from resilient.trainer.state import capture_state

    return local_tensors(flatten_state(capture_state(trainer.parts, trainer.step, trainer.tokens_seen)))


def _one_step(trainer: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """Train one step; its loss and the state's tensors after it (cloned)."""
    result = trainer.train_step(trainer.parts.data.next_batch())
    assert result.committed
    return result.loss, {fqn: t.clone() for fqn, t in _tensors(trainer).items()}


def _reinit_rank(rank: int, world: int, root: str, layout: tuple[str, ...]) -> dict[str, Any]:
    from resilient.rng import capture_rng_state
    from resilient.trainer.build import reinitialize

    untouched = _trainer(os.path.join(root, "untouched"), layout)
    try:  # a fresh run with checkpoint.resume off: no restore target is built before step 1
        untouched_loss = untouched.train_step(untouched.parts.data.next_batch()).loss
        untouched_after = {fqn: t.clone() for fqn, t in _tensors(untouched).items()}
    finally:
        untouched.close()
    fresh = _trainer(os.path.join(root, "fresh"), layout)
    try:
        initial = {fqn: t.clone() for fqn, t in _tensors(fresh).items()}  # as resume builds its target
        fresh_loss, fresh_after = _one_step(fresh)
    finally:
        fresh.close()
    restarted = _trainer(os.path.join(root, "restarted"), layout)
    try:
        rng = capture_rng_state()
        for tensor in _tensors(restarted).values():  # a RAM step landing in place, then ruled out
            tensor.fill_(7.0)
        reinitialize(restarted.config, restarted.mesh, restarted.device, restarted.parts)
        back = _tensors(restarted)
        differ = sorted(fqn for fqn, t in initial.items() if not torch.equal(back[fqn], t))
        rng_kept = capture_rng_state() == rng
        loss, after = _one_step(restarted)
    finally:
        restarted.close()
    return {
        "tensors": len(initial),
        "optim_tensors": sum(fqn.startswith("optim.") for fqn in initial),
        "same_names": sorted(back) == sorted(initial),
        "differ_after_reinit": differ,
        "rng_kept": rng_kept,
        "same_loss": loss == fresh_loss,
        "resume_off_same_loss": untouched_loss == fresh_loss,
        "resume_off_differ": sorted(fqn for fqn, t in fresh_after.items() if not torch.equal(untouched_after[fqn], t)),
        "differ_after_a_step": sorted(fqn for fqn, t in fresh_after.items() if not torch.equal(after[fqn], t)),
    }


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reinit_puts_back_the_state_a_fresh_build_trains_from(tmp_path: Path, layout: str) -> None:
    results = run_world(_reinit_rank, 2, str(tmp_path), LAYOUTS[layout], timeout_s=150)
    for r in results:
        # Every tensor (parameters, both AdamW moments, the step counters) is written back bit for
        # bit, the global RNGs are as the fresh start left them, and the next step is the same.
        assert r["tensors"] > 10 and r["optim_tensors"] > 0 and r["same_names"]
        assert r["differ_after_reinit"] == [] and r["rng_kept"]
        assert r["same_loss"] and r["differ_after_a_step"] == []
        # Building the restore target (resume on) materializes the optimizer's state without
        # counting a step: the first step is the one a run with resume off takes, bit for bit.
        assert r["resume_off_same_loss"] and r["resume_off_differ"] == []
