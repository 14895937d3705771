"""``verify``: a healthy checkpoint exits 0; a flipped byte, a truncated and a missing shard object
each exit 1 naming the step, the tensor and the chunk."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

W = "model.embed.weight"


def _shard_object(root: str, fqn: str) -> str:
    (path,) = glob.glob(os.path.join(root, "step-000000005", "attempt-*", *fqn.split("."), "c", "0", "0"))
    return path


def _damaged_copy(tmp_path, root: str, name: str, damage) -> str:
    copy = str(tmp_path / name)
    shutil.copytree(root, copy)
    damage(_shard_object(copy, W))
    return copy


def _flip(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 3] ^= 0x5A
    Path(path).write_bytes(bytes(data))


def _truncate(path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 40])


def test_healthy_checkpoint_verifies(saved, cli):
    root, _ = saved
    report = cli.json("verify", root)
    assert report["ok"] and len(report["steps"]) == 1
    step = report["steps"][0]
    assert step["step"] == 5 and step["tensors"] == 5 and step["problems"] == []
    assert step["bytes_read"] == 96 * 40 * 4 + 40 * 24 * 2 + 8 + 10 * 8
    rc, out, _ = cli("verify", root, "--all")
    assert rc == 0 and "step 5" in out and "OK" in out


@pytest.mark.parametrize("damage,kind", [(_flip, "checksum"), (_truncate, "checksum"), (os.remove, "missing-object")])
def test_damage_is_found_and_named(tmp_path, saved, cli, damage, kind):
    root, _ = saved
    copy = _damaged_copy(tmp_path, root, damage.__name__, damage)
    report = cli.json("verify", copy, expect=1)
    (problem,) = report["steps"][0]["problems"]
    assert problem["fqn"] == W and problem["step"] == 5 and problem["kind"] == kind
    assert problem["chunk"] == "model/embed/weight/c/0/0"
    assert W in problem["message"] and "step 5" in problem["message"]
    rc, out, _ = cli("verify", copy)
    assert rc == 1 and "1 PROBLEM(S)" in out and W in out
    # The other tensors of the same step still read: only the damaged one is reported.
    assert cli.json("verify", copy, "--tensors", "optim.*")["ok"]


def test_wrong_bytes_under_a_valid_checksum_are_found(tmp_path, saved, cli):
    """An intact chunk from another checkpoint passes TensorStore's crc32c; the manifest's crc catches it."""
    from resilient import Checkpointer
    from tests.tools.conftest import mixed_state

    root, _ = saved
    other = str(tmp_path / "other")
    Checkpointer(other).save(5, mixed_state(3.0)).wait()
    copy = _damaged_copy(tmp_path, root, "swapped", lambda path: shutil.copyfile(_shard_object(other, W), path))
    (problem,) = cli.json("verify", copy, expect=1)["steps"][0]["problems"]
    assert problem["fqn"] == W and problem["kind"] == "checksum" and "manifest records" in problem["message"]
