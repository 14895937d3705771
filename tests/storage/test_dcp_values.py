"""The one mapping of non-tensor values: our grouping of DCP's leaves, and DCP's flattening rule
reproduced for a stored value (checked against DCP's own flatten_state_dict)."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from resilient.errors import StateError
from resilient.storage.dcp.values import (
    JSON,
    TORCH_SAVE,
    as_torch_save,
    dcp_leaves,
    decode,
    encode,
    fqn_of,
    group_values,
    like,
)

pytestmark = pytest.mark.timeout(30)

VALUES = [
    {"lr": 0.1, "betas": [0.9, 0.99], "params": ["a", "b"]},
    [{"lr": 0.1}, {"lr": 0.2, "nested": [[1, 2], [3]]}],
    [[1, [2, {"deep": True}]], 3],
    {"empty": {}, "none": None, "s": "x"},
    7,
]


@pytest.mark.parametrize("value", VALUES)
def test_leaves_are_the_ones_dcp_flattens(value) -> None:
    flat, mappings = flatten_state_dict({"k": value})
    ours = {fqn_of(path): leaf for path, leaf in dcp_leaves(("k",), value)}
    assert ours == flat
    assert {fqn_of(p): p for p, _ in dcp_leaves(("k",), value)} == mappings


def test_tensor_free_subtrees_group_as_the_checkpointer_stores_them() -> None:
    state = {
        "model": {"w": torch.ones(2)},
        "optim": {"state": {"w": {"step": torch.ones(())}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "extra": {"epoch": 3, "tags": {"a": 1}},
        "mixed": {"n": 1, "blob": b"xy"},
        "top": 5,
    }
    flat, mappings = flatten_state_dict(state)
    tensors = {f for f, v in flat.items() if isinstance(v, torch.Tensor)}
    assert group_values(state, mappings, tensors) == {
        "optim.param_groups": ("optim", "param_groups"),
        "extra": ("extra",),
        "mixed.n": ("mixed", "n"),  # a subtree holding bytes is not JSON: its leaves go one by one
        "mixed.blob": ("mixed", "blob"),
        "top": ("top",),
    }


def test_encodings_round_trip_and_refuse() -> None:
    assert decode("k", JSON, encode("k", {"a": [1, None]}).getvalue()) == {"a": [1, None]}
    assert decode("k", "bytes", encode("k", b"\x00").getvalue()) == b"\x00"
    assert decode("k", "BytesIO", encode("k", io.BytesIO(b"z")).getvalue()).getvalue() == b"z"
    with pytest.raises(StateError, match="'k.x' is a builtins.set"):
        encode("k", {"x": {1}})
    with pytest.raises(StateError, match="never unpickles"):
        decode("k", TORCH_SAVE, b"")
    assert torch.load(as_torch_save(JSON, b'{"a": 1}'), weights_only=True) == {"a": 1}
    assert like((0.9, 0.99), [0.8, 0.9]) == (0.8, 0.9)
    assert like({"b": (1,)}, {"b": [2], "c": [3]}) == {"b": (2,), "c": [3]}
