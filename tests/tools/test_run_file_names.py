"""The demos name run files through ``resilient.runfiles``: a renamed file cannot leave a demo
pointing at a path that no longer exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from resilient import runfiles

TOOLS = Path(__file__).resolve().parents[2] / "tools"
RUN_FILE_NAMES = {
    value for name, value in vars(runfiles).items() if name.endswith(("_FILE", "_DIR")) and isinstance(value, str)
}


@pytest.mark.timeout(10)
def test_demos_spell_no_run_file_name() -> None:
    assert {"events.jsonl", "metrics.jsonl", "ram.jsonl", "logs"} <= RUN_FILE_NAMES
    spelled = []
    for path in sorted(TOOLS.glob("demo*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                # Whole words of every string part, f-strings included ("from events.jsonl):").
                words = node.value.replace("(", " ").replace(")", " ").replace(",", " ").replace(":", " ").split()
                spelled += [f"{path.name}: {w!r}" for w in words if w in RUN_FILE_NAMES and "." in w]
    assert spelled == []
