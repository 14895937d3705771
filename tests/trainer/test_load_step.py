"""``checkpoint.load_step`` reaches the restore policy from the trainer's recipe (issue 13 item 11):
the trainer resumes from the chosen step, and refuses while newer committed steps would be saved
over (the policy's rule, tested in tests/recovery/test_restore_fallback.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_world

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


def _trainer(run_dir: str, *extra: str) -> Any:
    from resilient.trainer.config import load_config
    from resilient.trainer.train import build_trainer

    overrides = [f"run.dir={run_dir}", "parallel.dp_shard=1", "parallel.tp=1", "data.num_workers=0", *extra]
    return build_trainer(load_config(TINY, overrides), torch.device("cpu"))


def _load_step_runs(rank: int, world: int, run_dir: str) -> dict:
    first = _trainer(run_dir, "run.steps=2", "checkpoint.persist_every=1")
    first.run()
    first.close()
    chosen = _trainer(run_dir, "run.steps=2", "checkpoint.load_step=1")
    try:
        chosen.resume()
        outcome = "resumed"
    except Exception as e:  # the policy's refusal, as the operator would read it
        outcome = f"{type(e).__name__}: {e}"
    finally:
        chosen.close()
    return {"outcome": outcome, "step": chosen.step, "committed": first.checkpointer.steps()}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_load_step_from_the_recipe_reaches_the_restore_policy(tmp_path: Path) -> None:
    (result,) = run_world(_load_step_runs, 1, str(tmp_path / "run"), timeout_s=100)
    assert result["committed"] == [1, 2]
    # Without the wiring the trainer would resume from step 2 and report nothing to train.
    assert result["outcome"].startswith("ConfigError") and "2" in result["outcome"], result
    assert "load_step" in result["outcome"], result
    assert os.path.isdir(tmp_path / "run")
