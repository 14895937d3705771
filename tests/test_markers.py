"""`make check` leaves out the tests marked `dist` or `e2e`: a test that starts a gloo world or a
torchrun job must carry one of those marks, or the fast loop quietly grows by its minutes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

TESTS = Path(__file__).resolve().parent
MULTI_PROCESS_CALLS = {"run_world", "start_world", "run_torchrun", "torchrun"}
"""Helpers that start several ranks (tests/dist.py) or a torchrun job."""


def _marks(node: ast.AST) -> set[str]:
    out = set()
    for deco in getattr(node, "decorator_list", []):
        text = ast.unparse(deco)
        out |= {m for m in ("dist", "e2e") if f"mark.{m}" in text}
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            text = ast.unparse(node.value)
            return {m for m in ("dist", "e2e") if f"mark.{m}" in text}
    return set()


def _calls(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            names.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
        elif isinstance(sub, ast.Constant) and sub.value == "torchrun":
            names.add("torchrun")
    return names


def unmarked_multi_process_tests(root: Path = TESTS) -> list[str]:
    out = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module = _module_marks(tree)
        helpers = {
            n.name: _calls(n) for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test")
        }
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            calls = _calls(node)
            for name in list(calls):  # one level of the module's own helpers
                calls |= helpers.get(name, set())
            if calls & MULTI_PROCESS_CALLS and not (module | _marks(node)):
                out.append(f"{path.relative_to(root.parent)}::{node.name}")
    return out


def test_multi_process_tests_are_marked() -> None:
    assert unmarked_multi_process_tests() == []


def test_the_check_catches_an_unmarked_world(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def _go():\n    return run_world(f, 2)\n"
        "def test_a():\n    _go()\n"
        "@pytest.mark.dist\ndef test_b():\n    run_world(f, 2)\n"
        "def test_c():\n    subprocess.run(['torchrun', 'x'])\n"
        "def test_d():\n    assert 1\n"
    )
    found = unmarked_multi_process_tests(tmp_path)
    assert found == [f"{tmp_path.name}/test_x.py::test_{t}" for t in ("a", "c")]
