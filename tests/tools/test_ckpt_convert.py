"""``convert``: resilient -> safetensors -> resilient and resilient -> torch -> resilient, values
compared; safetensors output read by the safetensors library; peak memory bounded by --max-memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from resilient import Checkpointer
from tests.tools.conftest import assert_same_state, tensors_of, zeros_like_state

pytestmark = pytest.mark.timeout(120)


def _load(root: str, like: dict) -> tuple[int, dict]:
    target = zeros_like_state(like)
    return Checkpointer(root).load(target), target


def test_safetensors_round_trip(tmp_path, saved, cli):
    from safetensors import safe_open

    root, state = saved
    out = str(tmp_path / "st")
    # 4 KiB files: the 15 KiB embedding gets a file alone, the other 2 KiB share the second.
    result = cli.json("convert", root, out, "--to", "safetensors", "--max-shard-size", "4KiB")
    assert result["from"] == "resilient" and result["tensors"] == 5 and len(result["files"]) == 2
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(tensors_of(state)) and index["metadata"]["total_size"] == result["bytes"]
    assert index["weight_map"]["model.embed.weight"] == "model-00001-of-00002.safetensors"
    assert {index["weight_map"][k] for k in index["weight_map"] if k != "model.embed.weight"} == {
        "model-00002-of-00002.safetensors"
    }
    for fqn, expected in tensors_of(state).items():
        with safe_open(os.path.join(out, index["weight_map"][fqn]), framework="pt") as f:
            got = f.get_tensor(fqn)
            assert f.metadata()["format"] == "pt"
        assert got.dtype == expected.dtype and torch.equal(got, expected), fqn

    back = str(tmp_path / "back")
    assert cli.json("convert", out, back, "--to", "resilient")["step"] == 5  # step and values ride along
    step, loaded = _load(back, state)
    assert step == 5
    assert_same_state(loaded, state)
    assert cli.json("verify", back)["ok"]


def test_torch_round_trip(tmp_path, saved, cli):
    root, state = saved
    out = str(tmp_path / "pt")
    result = cli.json("convert", root, out, "--to", "torch")
    (name,) = result["files"]
    plain = torch.load(os.path.join(out, name), weights_only=True)  # a flat state dict, no pickled objects
    assert plain.keys() == tensors_of(state).keys() and torch.equal(
        plain["model.proj.weight"], state["model"]["proj"]["weight"]
    )
    back = str(tmp_path / "back")
    assert cli.json("convert", out, back, "--to", "resilient")["from"] == "torch"
    step, loaded = _load(back, state)
    assert step == 5
    assert_same_state(loaded, state)

    # A user's own torch.save file (nested, with plain values) imports too.
    own = tmp_path / "own.pt"
    torch.save({"model": {"w": torch.ones(3, 2)}, "epoch": 4}, own)
    imported = cli.json("convert", str(own), str(tmp_path / "own"), "--to", "resilient", "--out-step", "2")
    assert imported["tensors"] == 1 and imported["values"] == 1 and imported["step"] == 2


def test_dtype_cast_and_tensor_selection(tmp_path, saved, cli):
    from safetensors import safe_open

    root, state = saved
    out = str(tmp_path / "bf16")
    result = cli.json("convert", root, out, "--to", "safetensors", "--dtype", "bfloat16", "--tensors", "model.*")
    assert result["tensors"] == 3 and result["values"] == 0
    (name,) = result["files"]
    with safe_open(os.path.join(out, name), framework="pt") as f:
        assert set(f.keys()) == {"model.embed.weight", "model.proj.weight", "model.proj.bias"}
        embed = f.get_tensor("model.embed.weight")
    assert embed.dtype == torch.bfloat16 and torch.equal(embed, state["model"]["embed"]["weight"].to(torch.bfloat16))
    rc, _, err = cli("convert", root, str(tmp_path / "x"), "--to", "torch", "--dtype", "int8")
    assert rc == 2 and "floating-point" in err


_MEASURE = """
import json, resource, sys
from resilient.tools.ckpt import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""
_MAKE = """
import sys, torch
from resilient import Checkpointer
for root, n, rows in ((sys.argv[1], 4, 16384), (sys.argv[2], 1, 16)):
    Checkpointer(root).save(1, {f"layer{i}": torch.full((rows, 1024), float(i)) for i in range(n)}).wait()
"""


def _measure(*argv: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, *argv, "--json"], capture_output=True, text=True, timeout=100
    )
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["rc"] == 0, done.stderr
    return last["max_rss_kib"] << 10


@pytest.mark.e2e  # four CLI processes, each importing torch
def test_convert_larger_than_max_memory_stays_bounded(tmp_path):
    """256 MiB of tensors through --max-memory 32MiB, both directions; peak RSS is compared with
    converting a 64 KiB state (the same code paths: the interpreter, torch and TensorStore)."""
    big, tiny = str(tmp_path / "big"), str(tmp_path / "tiny")
    subprocess.run([sys.executable, "-c", _MAKE, big, tiny], check=True, timeout=100)  # keeps pytest's RSS low
    baseline = _measure("convert", tiny, str(tmp_path / "tiny.st"), "--to", "safetensors", "--max-memory", "32MiB")
    export = _measure("convert", big, str(tmp_path / "big.st"), "--to", "safetensors", "--max-memory", "32MiB")
    back = _measure(
        "convert", str(tmp_path / "big.st"), str(tmp_path / "big2"), "--to", "resilient", "--max-memory", "32MiB"
    )
    state_bytes = 4 * 16384 * 1024 * 4
    for peak in (export, back):  # measured here: +20 MiB and +12 MiB
        assert peak - baseline < 2 * (32 << 20), (peak >> 20, baseline >> 20)
    assert os.path.getsize(tmp_path / "big.st" / "model-00001-of-00001.safetensors") > state_bytes
    last = torch.zeros(16384, 1024)
    Checkpointer(str(tmp_path / "big2")).load({"layer3": last}, strict=False)
    assert torch.equal(last, torch.full((16384, 1024), 3.0))
