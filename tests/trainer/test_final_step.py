"""Issue 13 item 1: a run never ends successfully unless its last step is committed to
``checkpoint.url`` — a restart that restored its last step from RAM persists it, and a run whose
last step is not committed fails on every rank together."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_world

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
STEPS = 1


def _trainer(run_dir: str, *extra: str) -> Any:
    from resilient.trainer.config import load_config
    from resilient.trainer.train import build_trainer

    overrides = [
        f"run.dir={run_dir}",
        "parallel.dp_shard=2",
        "parallel.tp=1",
        f"run.steps={STEPS}",
        f"checkpoint.persist_every={STEPS * 10}",  # only the last-step save
        "data.num_workers=0",  # rows built in this process: run_world ranks are daemons
        *extra,
    ]
    return build_trainer(load_config(TINY, overrides), torch.device("cpu"))


def _run(trainer: Any) -> str:
    try:
        trainer.run()
        return "ok"
    except Exception as e:  # what this rank saw: compared across ranks
        return f"{type(e).__name__}: {e}"
    finally:
        trainer.close()


def _committed(trainer: Any) -> list[int]:
    from resilient import StorageError

    try:
        return trainer.checkpointer.steps()
    except StorageError:  # nothing was ever saved: the checkpoint directory does not exist
        return []


def _final_step_runs(rank: int, world: int, root: str) -> dict:
    from resilient.recovery.restore import RestoreResult

    # A restart after the final save did not commit: the RAM tier holds the last step.
    restarted = _trainer(os.path.join(root, "restarted"))

    def restore_from_ram(peer: Any = None) -> RestoreResult:
        restarted.step, restarted.restored_from = STEPS, "own"
        return RestoreResult(STEPS, "own")

    restarted.resume = restore_from_ram
    result = {"restarted": _run(restarted), "restarted_steps": _committed(restarted)}
    # A run whose last save never happened (here: suppressed) must not end "successful".
    unsaved = _trainer(os.path.join(root, "unsaved"))
    unsaved.maybe_save = lambda: None
    result["unsaved"] = _run(unsaved)
    result["unsaved_step"] = unsaved.step
    # run.steps=0 on a fresh root: nothing trained, nothing to persist (step 0 is the initial state).
    nothing = _trainer(os.path.join(root, "nothing"), "run.steps=0")
    result["nothing"], result["nothing_steps"] = _run(nothing), _committed(nothing)
    return result


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_run_ends_successfully_only_with_its_last_step_committed(tmp_path: Path) -> None:
    results = run_world(_final_step_runs, 2, str(tmp_path), timeout_s=130)
    for r in results:
        assert r["restarted"] == "ok" and r["restarted_steps"] == [STEPS]
        assert r["unsaved_step"] == STEPS
        assert r["nothing"] == "ok" and r["nothing_steps"] == []
    # Raised on every rank, the same error, at the same call.
    assert results[0]["unsaved"] == results[1]["unsaved"]
    assert results[0]["unsaved"].startswith(
        f"ResilientError: the run ended at step {STEPS} but that step is not committed to "
    )
