"""The README's runnable examples run: each fenced block right after a ``<!-- runnable -->`` line
(``python`` or ``bash``) is executed as a user would paste it, in a fresh directory holding the
repository's ``configs/`` and, for the blocks that read one, the checkpoint the quick start's run
leaves (``runs/tiny``, step 40: written here from the tiny model's parameters, not trained)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^<!-- runnable(?P<note>[^>]*)-->\n```(?P<lang>python|bash)\n(?P<code>.*?)^```", re.M | re.S)


def runnable_blocks() -> list[tuple[str, str]]:
    return [(m["lang"], m["code"]) for m in BLOCK.finditer((REPO / "README.md").read_text())]


def _quick_start_checkpoint(root: Path) -> None:
    from resilient import Checkpointer
    from resilient.trainer.config import load_config
    from resilient.trainer.model import OmniModel

    model = OmniModel(load_config(str(REPO / "configs" / "tiny.toml")).model, seed=0)
    Checkpointer(str(root)).save(40, {"model": model.state_dict()}).wait(timeout=60)


@pytest.mark.timeout(10)
def test_the_readme_marks_runnable_examples() -> None:
    assert sorted(lang for lang, _ in runnable_blocks()) == ["bash", "python"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    lang, code = runnable_blocks()[index]
    (tmp_path / "configs").symlink_to(REPO / "configs")
    if "runs/tiny/ckpt" in code:
        _quick_start_checkpoint(tmp_path / "runs" / "tiny" / "ckpt")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, f"README {lang} block {index} failed:\n{code}\n{done.stdout}\n{done.stderr}"
