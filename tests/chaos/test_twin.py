"""The twin's cache key changes with whatever changes its bits outside the recipe."""

from __future__ import annotations

import sys

import pytest
import torch

from resilient.chaos import twin
from resilient.chaos.scenario import load_scenario

pytestmark = [pytest.mark.timeout(60)]


def test_twin_key_covers_torch_python_device_and_the_chaos_sources(monkeypatch) -> None:
    scenario = load_scenario("smoke")
    env = twin.environment_key(scenario)
    assert env["torch"] == torch.__version__ and env["python"] == list(sys.version_info[:2])
    assert env["device"] == ("cpu" if not torch.cuda.is_available() else f"cuda:{torch.cuda.get_device_name(0)}")
    key = twin.twin_hash(scenario)
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert twin.twin_hash(scenario) != key
    monkeypatch.undo()
    hashed: list[str] = []
    real_rglob = type(twin.REPO_ROOT).rglob

    def recording_rglob(self, pattern: str):  # noqa: ANN202
        hashed.append(self.name)
        return real_rglob(self, pattern)

    monkeypatch.setattr(type(twin.REPO_ROOT), "rglob", recording_rglob)
    twin.code_hash()
    assert "chaos" in hashed, "the hook's digest format is part of the key"
