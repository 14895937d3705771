"""Single-process Checkpointer: round trips, retention, zarr-python interop, no pickle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from resilient import Checkpointer
from resilient.rng import capture_rng_state, restore_rng_state

pytestmark = pytest.mark.timeout(60)


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "layers.0.w": torch.randn(64, 48, generator=g),
            "layers.0.b": torch.randn(48, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0, 3),
            "ids": torch.arange(10, dtype=torch.int64) * (seed + 1),
            "mask": torch.tensor([True, False, True]),
        },
        "optim": {
            "state": {
                "layers.0.w": {"step": torch.tensor(float(seed + 5)), "exp_avg": torch.randn(64, 48, generator=g)}
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["layers.0.w"]}],
        },
        "step": 100 + seed,
        "data": {"version": 1, "fingerprint": "abc", "rows_consumed": 4096, "note": None},
    }


def zeros_like_state(state: dict) -> dict:
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return v if isinstance(v, tuple) else None

    return z(state)


def assert_state_equal(a: dict, b: dict) -> None:
    from resilient.state import flatten_state

    fa, fb = flatten_state(a), flatten_state(b)
    assert fa.keys() == fb.keys()
    for fqn in fa:
        x, y = fa[fqn].value, fb[fqn].value
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), fqn
        else:
            assert x == y, fqn


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_round_trip_every_leaf_kind(tmp_path, scheme):
    url = str(tmp_path / "ck") if scheme == "file" else f"memory://rt-{os.getpid()}/ck"
    ckpt = Checkpointer(url)
    state = make_state(1)
    stats = ckpt.save(10, state).wait()
    assert stats.outcome == "committed" and stats.bytes_total > 64 * 48 * 4
    target = zeros_like_state(state)
    assert ckpt.load(target) == 10
    assert_state_equal(target, state)
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples


def test_steps_load_by_step_and_keep_last(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep_last=2)
    states = {s: make_state(s) for s in (1, 2, 3)}
    for s, st in states.items():
        ckpt.save(s, st).wait()
    assert ckpt.steps() == [2, 3]
    assert not (tmp_path / "step-000000001").exists()
    target = zeros_like_state(states[2])
    assert ckpt.load(target, step=2) == 2
    assert_state_equal(target, states[2])
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 3}


def test_keep_last_zero_keeps_every_step_as_in_a_recipe(tmp_path):
    """checkpoint.keep_last = 0 in a recipe and CheckpointerConfig(keep_last=0) mean the same."""
    from resilient import CheckpointerConfig

    ckpt = Checkpointer(str(tmp_path), config=CheckpointerConfig(keep_last=0))
    for s in (1, 2, 3):
        ckpt.save(s, make_state(s)).wait()
    assert ckpt.steps() == [1, 2, 3]
    assert CheckpointerConfig(keep_last=None).keep_last == 0


def test_rng_state_round_trips_as_json(tmp_path):
    torch.manual_seed(5)
    state = {"rng": capture_rng_state()}
    expected = torch.rand(4)
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state).wait()
    torch.manual_seed(99)
    target = {"rng": {}}
    ckpt.load(target)
    restore_rng_state(target["rng"])
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.timeout(60)
def test_plain_zarr_python_opens_a_bf16_array_after_one_import_without_torch(tmp_path):
    Checkpointer(str(tmp_path)).save(1, {"w": torch.arange(6, dtype=torch.bfloat16)}).wait()
    (pack,) = (tmp_path / "step-000000001").glob("attempt-*/pack-r00000-0.zip")  # one process: one pack
    probe = (
        "import sys, zarr, resilient.zarr_bfloat16\n"
        f"a = zarr.open_array(zarr.storage.ZipStore({str(pack)!r}, mode='r'), path='w', mode='r')\n"
        "print(a.dtype, a[...].astype('float32').tolist(), 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert done.stdout.split(" ", 1) == ["bfloat16", "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0] False\n"], done.stderr[-2000:]


def test_zarr_python_reads_every_array_and_no_file_is_a_pickle(tmp_path):
    import zarr

    import resilient.zarr_bfloat16  # noqa: F401  (teaches zarr-python bfloat16)

    state = make_state(2)
    Checkpointer(str(tmp_path)).save(3, state).wait()
    manifest = json.loads((tmp_path / "step-000000003" / "manifest.json").read_text())
    (pack,) = (tmp_path / "step-000000003").glob("attempt-*/pack-*.zip")
    group = zarr.open_group(zarr.storage.ZipStore(str(pack), mode="r"), mode="r")
    from resilient.dtypes import to_numpy
    from resilient.state import flatten_state

    for fqn, leaf in flatten_state(state).items():
        if not leaf.is_tensor:
            assert manifest["values"][fqn]["value"] == json.loads(json.dumps(leaf.value)), fqn
            continue
        got = group[fqn.replace(".", "/")][...]
        assert got.dtype == to_numpy(leaf.value).dtype, fqn
        np.testing.assert_array_equal(got, to_numpy(leaf.value), err_msg=fqn)
    n_json = 0
    for root, _, files in os.walk(tmp_path):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read()
            assert not data.startswith(b"\x80"), f"{path} starts like a pickle"
            if name.endswith(".zip"):  # a pack: shard objects, and zarr.json documents that are JSON
                with zipfile.ZipFile(path) as z:
                    for entry in z.namelist():
                        assert not z.read(entry).startswith(b"\x80"), f"{entry} in {path} starts like a pickle"
                        if entry.endswith("zarr.json"):
                            json.loads(z.read(entry))
                            n_json += 1
            else:
                json.loads(data)
                n_json += 1
    assert n_json >= 3 + len(flatten_state(state))  # manifest, latest, receipts, group + array docs
