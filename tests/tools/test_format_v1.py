"""Format versions 1 (shard objects under ``c/``) and 2 (one object per shard, ``<array>/1.0``)
stay readable, and ``resilient-ckpt convert`` upgrades them to version 3 (packs).

There is no version-1 or version-2 writer any more, so the test makes them from a version-3 step
the way they laid it out: version 2 is every pack entry as its own object (the same bytes under
the same keys) and a manifest without ``shards``; version 1 is that under "default" chunk keys,
the arrays' ``zarr.json`` declaring that encoding. Every layout is checked against zarr-python,
which knows nothing about resilient.
"""

from __future__ import annotations

import glob
import json
import os
import re
import zipfile

import numpy as np
import pytest
import zarr

import resilient.zarr_bfloat16  # noqa: F401  (zarr-python reads bfloat16 arrays)
from resilient import Checkpointer
from resilient.dtypes import to_numpy
from resilient.manifest import MANIFEST, step_dir
from tests.tools.conftest import assert_same_state, tensors_of, zeros_like_state

pytestmark = pytest.mark.timeout(120)

V2_KEY = re.compile(r"^\d+(\.\d+)*$")


def _attempt(root: str, step: int) -> str:
    with open(os.path.join(root, step_dir(step), MANIFEST)) as f:
        return os.path.join(root, step_dir(step), json.load(f)["attempt"])


def _unpack_to_v2(root: str, step: int) -> int:
    """Rewrite a committed version-3 step in version 2's layout; returns the shard objects made."""
    attempt, made = _attempt(root, step), 0
    for pack in glob.glob(os.path.join(attempt, "pack-*.zip")):
        with zipfile.ZipFile(pack) as z:
            for name in z.namelist():
                os.makedirs(os.path.dirname(os.path.join(attempt, name)), exist_ok=True)
                with open(os.path.join(attempt, name), "wb") as f:
                    f.write(z.read(name))
                made += not name.endswith("zarr.json")
        os.remove(pack)
    manifest_path = os.path.join(root, step_dir(step), MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["format_version"] = 2
    manifest.pop("tensorstore")
    for entry in manifest["arrays"].values():
        entry.pop("shards")
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return made


def _downgrade_to_v1(root: str, step: int) -> int:
    """Rewrite a committed step in version 1's layout; returns the shard objects moved."""
    _unpack_to_v2(root, step)
    attempt, moved = _attempt(root, step), 0
    for doc_path in glob.glob(os.path.join(attempt, "**", "zarr.json"), recursive=True):
        with open(doc_path) as f:
            doc = json.load(f)
        if doc["node_type"] != "array":
            continue
        array_dir = os.path.dirname(doc_path)
        for name in os.listdir(array_dir):
            if V2_KEY.match(name):
                indices = name.split(".") if doc["shape"] else []
                target = os.path.join(array_dir, "c", *indices)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.rename(os.path.join(array_dir, name), target)
                moved += 1
        doc["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
        with open(doc_path, "w") as f:
            json.dump(doc, f)
    manifest_path = os.path.join(root, step_dir(step), MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["format_version"] = 1
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return moved


def _non_empty(state: dict) -> int:
    """Shard objects of the state: one per non-empty tensor (an empty one has no data)."""
    return sum(t.numel() > 0 for t in tensors_of(state).values())


def _assert_zarr_python_reads(root: str, step: int, state: dict) -> None:
    """Versions 1 and 2 are a zarr group directory; version 3 of one writer is one pack, a ZIP."""
    packs = glob.glob(os.path.join(_attempt(root, step), "pack-*.zip"))
    group = zarr.open_group(zarr.storage.ZipStore(packs[0], mode="r") if packs else _attempt(root, step), mode="r")
    for fqn, expected in tensors_of(state).items():
        got = group[fqn.replace(".", "/")][...]
        np.testing.assert_array_equal(got, to_numpy(expected), err_msg=fqn)


def test_version_2_loads_verifies_and_converts_to_version_3(tmp_path, saved, cli):
    root, state = saved
    assert _unpack_to_v2(root, 5) == _non_empty(state)
    attempt = _attempt(root, 5)
    assert not glob.glob(os.path.join(attempt, "**", "c"), recursive=True)
    shard_objects = [
        p for p in glob.glob(os.path.join(attempt, "**"), recursive=True) if V2_KEY.match(os.path.basename(p))
    ]
    assert len(shard_objects) == _non_empty(state)
    _assert_zarr_python_reads(root, 5, state)
    target = zeros_like_state(state)
    assert Checkpointer(root).load(target) == 5
    assert_same_state(target, state)
    assert cli.json("verify", root)["ok"]
    assert cli.json("inspect", root)["format_version"] == 2
    upgraded = str(tmp_path / "upgraded")
    assert cli.json("convert", root, upgraded, "--to", "resilient")["step"] == 5
    assert cli.json("inspect", upgraded)["format_version"] == 3
    assert [os.path.basename(p) for p in glob.glob(os.path.join(_attempt(upgraded, 5), "*"))] == ["pack-r00000-0.zip"]
    target = zeros_like_state(state)
    assert Checkpointer(upgraded).load(target) == 5
    assert_same_state(target, state)
    assert cli.json("verify", upgraded)["ok"]
    _assert_zarr_python_reads(upgraded, 5, state)
    rc, _, _ = cli("diff", root, upgraded)  # version 2 against version 3: the same values
    assert rc == 0


def test_version_1_loads_verifies_and_converts_to_version_3(tmp_path, saved, cli):
    root, state = saved
    assert _downgrade_to_v1(root, 5) == _non_empty(state)
    _assert_zarr_python_reads(root, 5, state)  # the rewritten step is a valid version-1 layout

    # (TensorStore's reads of version-1 keys are compared with the direct reader in test_localread.)
    target = zeros_like_state(state)
    assert Checkpointer(root).load(target) == 5
    assert_same_state(target, state)
    assert cli.json("verify", root)["ok"]
    assert cli.json("inspect", root)["format_version"] == 1

    upgraded = str(tmp_path / "upgraded")
    assert cli.json("convert", root, upgraded, "--to", "resilient")["step"] == 5
    assert cli.json("inspect", upgraded)["format_version"] == 3
    assert not glob.glob(os.path.join(_attempt(upgraded, 5), "**", "c"), recursive=True)
    target = zeros_like_state(state)
    assert Checkpointer(upgraded).load(target) == 5
    assert_same_state(target, state)
    assert cli.json("verify", upgraded)["ok"]
    _assert_zarr_python_reads(upgraded, 5, state)
    rc, _, _ = cli("diff", root, upgraded)  # version 1 against version 3: the same values
    assert rc == 0

    resharded = str(tmp_path / "resharded")  # reshard reads version 1 and writes version 3
    cli.json("reshard", root, resharded, "--chunks", "model.embed.weight=48,40")
    assert cli.json("inspect", resharded)["format_version"] == 3
    target = zeros_like_state(state)
    assert Checkpointer(resharded).load(target) == 5
    assert_same_state(target, state)


def test_a_root_with_version_1_and_version_3_steps_saves_loads_and_prunes(saved, cli):
    root, state = saved
    _downgrade_to_v1(root, 5)
    newer = {**state, "data": {"rows_consumed": 8192, "seed": 7}}
    Checkpointer(root).save(6, newer).wait()  # a version-3 step on top of a version-1 one
    assert [cli.json("inspect", root, "--step", str(s))["format_version"] for s in (5, 6)] == [1, 3]
    for step, expected in ((5, state), (6, newer)):
        target = zeros_like_state(state)
        assert Checkpointer(root).load(target, step=step) == step
        assert_same_state(target, expected)
    rc, _, _ = cli("verify", root, "--all")
    assert rc == 0
    cli.json("prune", root, "--keep-last", "1")
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [step_dir(6)]


def test_a_damaged_version_1_shard_is_named_by_its_version_1_key(saved, cli):
    root, _ = saved
    _downgrade_to_v1(root, 5)
    (path,) = glob.glob(os.path.join(_attempt(root, 5), "model", "embed", "weight", "c", "0", "0"))
    with open(path, "r+b") as f:
        f.seek(8)
        byte = f.read(1)
        f.seek(8)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = cli.json("verify", root, expect=1)
    (problem,) = report["steps"][0]["problems"]
    assert problem["kind"] == "checksum" and problem["chunk"] == "model/embed/weight/c/0/0", problem
