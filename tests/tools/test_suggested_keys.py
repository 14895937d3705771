"""Every recipe key an error or a printed message names exists: what a message tells the user to
``--set`` must be accepted by ``--set`` (a message that names a Python field, or a key renamed
since, sends the user to a second error)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from resilient.trainer.config import _SECTIONS, allowed_keys, load_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("resilient", "storage", "recovery", "trainer", "tools", "chaos")
KEY = re.compile(rf"(?<![\w./-])({'|'.join(_SECTIONS)})\.([a-z_][a-z0-9_]*)(?![\w(])")
SPEAKERS = {"print", "warning", "error", "info", "message", "say", "write", "exit", "fail"}
"""Calls whose string arguments a user reads (besides every ``raise`` and every error built)."""


def _called(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def suggested_keys() -> dict[str, set[str]]:
    """``section.key`` -> the files whose messages name it."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                called = _called(node) if isinstance(node, ast.Call) else ""
                speaks = isinstance(node, ast.Raise) or called in SPEAKERS or called.endswith(("Error", "Timeout"))
                if not speaks:
                    continue
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        for m in KEY.finditer(sub.value):
                            found.setdefault(f"{m.group(1)}.{m.group(2)}", set()).add(path.name)
    return found


@pytest.mark.timeout(60)
def test_every_key_a_message_suggests_is_a_valid_set() -> None:
    keys = suggested_keys()
    assert {"checkpoint.commit_timeout_s", "checkpoint.close_timeout_s", "checkpoint.staging_bytes"} <= set(keys)
    unknown = {k: sorted(v) for k, v in keys.items() if k.partition(".")[2] not in allowed_keys(k.partition(".")[0])}
    assert unknown == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override",
    ["checkpoint.commit_timeout_s=60", "checkpoint.close_timeout_s=60", "checkpoint.staging_bytes=1048576"],
)
def test_the_timeout_and_staging_keys_messages_name_are_accepted(override: str) -> None:
    load_config(None, [override])
