"""Shared helpers for the resilient-ckpt tests: a small mixed-dtype state, and running the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from resilient import Checkpointer
from resilient.tools.ckpt import main


def mixed_state(scale: float = 1.0) -> dict:
    """fp32, bf16, int64, a 0-d counter, an empty tensor, and JSON values (nested dict, list)."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed": {"weight": torch.randn(96, 40, generator=g) * scale},
            "proj": {
                "weight": (torch.randn(40, 24, generator=g) * scale).to(torch.bfloat16),
                "bias": torch.zeros(0, 3),
            },
        },
        "optim": {"step": torch.tensor(12), "ids": torch.arange(10, dtype=torch.int64)},
        "data": {"rows_consumed": 4096, "seed": 7},
        "tags": ["a", "b"],
    }


def tensors_of(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(tensors_of(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def zeros_like_state(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = zeros_like_state(value)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = None
    return out


def assert_same_state(loaded: dict, expected: dict) -> None:
    got, want = tensors_of(loaded), tensors_of(expected)
    assert got.keys() == want.keys()
    for fqn, t in want.items():
        assert got[fqn].dtype == t.dtype and got[fqn].shape == t.shape, fqn
        assert torch.equal(got[fqn], t), fqn
    assert loaded["data"] == expected["data"] and list(loaded["tags"]) == expected["tags"]


@pytest.fixture
def saved(tmp_path) -> tuple[str, dict]:
    """A local checkpoint with the mixed state committed at step 5."""
    root = str(tmp_path / "ckpt")
    state = mixed_state()
    Checkpointer(root).save(5, state).wait()
    return root, state


class Cli:
    def __init__(self, capsys) -> None:
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        rc = main(list(argv))
        captured = self.capsys.readouterr()
        return rc, captured.out, captured.err

    def json(self, *argv: str, expect: int = 0) -> dict:
        rc, out, err = self(*argv, "--json")
        assert rc == expect, (rc, err)
        return json.loads(out)


@pytest.fixture
def cli(capsys) -> Cli:
    return Cli(capsys)
