"""``verify``: a healthy checkpoint exits 0; a flipped byte exits 1 naming the step, the tensor and
the chunk; a cut or missing pack exits 1 naming the step and every tensor it held."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

W = "model.embed.weight"


def _shard_range(root: str, fqn: str, step: int = 5) -> tuple[str, int, int]:
    """(pack file, offset, length) of the tensor's shard "0.0"/"0" (format version 3)."""
    step_root = os.path.join(root, f"step-{step:09d}")
    with open(os.path.join(step_root, "manifest.json")) as f:
        manifest = json.load(f)
    pack, offset, nbytes = next(iter(manifest["arrays"][fqn]["shards"].values()))
    return os.path.join(step_root, manifest["attempt"], pack), offset, nbytes


def _damaged_copy(tmp_path, root: str, name: str, damage) -> str:
    copy = str(tmp_path / name)
    shutil.copytree(root, copy)
    damage(*_shard_range(copy, W))
    return copy


def _flip(path: str, offset: int, nbytes: int) -> None:
    data = bytearray(Path(path).read_bytes())
    data[offset + nbytes // 3] ^= 0x5A
    Path(path).write_bytes(bytes(data))


def _truncate(path: str, offset: int, nbytes: int) -> None:
    """Cut the pack inside the shard: it, every entry after it and the ZIP directory are gone."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: offset + nbytes - 40])


def _remove(path: str, offset: int, nbytes: int) -> None:
    os.remove(path)


def test_healthy_checkpoint_verifies(saved, cli):
    root, _ = saved
    report = cli.json("verify", root)
    assert report["ok"] and len(report["steps"]) == 1
    step = report["steps"][0]
    assert step["step"] == 5 and step["tensors"] == 5 and step["problems"] == []
    assert step["bytes_read"] == 96 * 40 * 4 + 40 * 24 * 2 + 8 + 10 * 8
    rc, out, _ = cli("verify", root, "--all")
    assert rc == 0 and "step 5" in out and "OK" in out


def test_a_flipped_byte_is_found_and_named(tmp_path, saved, cli):
    root, _ = saved
    copy = _damaged_copy(tmp_path, root, "flip", _flip)
    report = cli.json("verify", copy, expect=1)
    (problem,) = report["steps"][0]["problems"]
    assert problem["fqn"] == W and problem["step"] == 5 and problem["kind"] == "checksum"
    assert problem["chunk"] == "model/embed/weight/0.0"
    assert W in problem["message"] and "step 5" in problem["message"]
    rc, out, _ = cli("verify", copy)
    assert rc == 1 and "1 PROBLEM(S)" in out and W in out
    # The other tensors of the same step still read: only the damaged one is reported.
    assert cli.json("verify", copy, "--tensors", "optim.*")["ok"]


@pytest.mark.parametrize("damage,kind", [(_truncate, "unreadable"), (_remove, "missing-object")])
def test_a_cut_or_missing_pack_names_every_tensor_it_held(tmp_path, saved, cli, damage, kind):
    root, state = saved
    copy = _damaged_copy(tmp_path, root, damage.__name__, damage)
    report = cli.json("verify", copy, expect=1)
    problems = report["steps"][0]["problems"]
    held = ["model.embed.weight", "model.proj.weight", "optim.ids", "optim.step"]  # one writer: one pack
    assert sorted(p["fqn"] for p in problems) == held  # model.proj.bias is empty: no data to lose
    for problem in problems:
        assert problem["step"] == 5 and problem["kind"] == kind, problem
        assert "pack-r00000-0.zip" in problem["message"] and "step 5" in problem["message"], problem


def test_wrong_bytes_under_a_valid_checksum_are_found(tmp_path, saved, cli):
    """An intact chunk from another checkpoint passes TensorStore's crc32c; the manifest's crc catches it."""
    from resilient import Checkpointer
    from tests.tools.conftest import mixed_state

    root, _ = saved
    other = str(tmp_path / "other")
    Checkpointer(other).save(5, mixed_state(3.0)).wait()
    source, offset, nbytes = _shard_range(other, W)
    with open(source, "rb") as f:
        f.seek(offset)
        theirs = f.read(nbytes)

    def swap(path: str, at: int, length: int) -> None:
        assert length == nbytes  # the same shapes: the same shard length
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(theirs)

    copy = _damaged_copy(tmp_path, root, "swapped", swap)
    (problem,) = cli.json("verify", copy, expect=1)["steps"][0]["problems"]
    assert problem["fqn"] == W and problem["kind"] == "checksum" and "manifest records" in problem["message"]


def _six_steps_five_damaged(root: str) -> None:
    """Step 1 intact; 2 a truncated manifest; 3 a flipped chunk byte; 4 a missing chunk object; 5 a
    manifest that is JSON but no manifest; 6 (which `latest` names) its manifest deleted."""
    import torch

    from resilient import Checkpointer

    ckpt = Checkpointer(root)
    for step in range(1, 7):
        ckpt.save(step, {"w": torch.arange(64.0).reshape(8, 8) * step, "n": step}).wait()
    manifest = os.path.join(root, "step-00000000{}", "manifest.json").format
    with open(manifest(2), "r+") as f:
        f.truncate(20)
    _flip(*_shard_range(root, "w", 3))
    _remove(*_shard_range(root, "w", 4))
    Path(manifest(5)).write_text('{"format": "resilient", "format_version": 1}')
    os.remove(manifest(6))


@pytest.mark.timeout(60)
def test_verify_all_reports_each_damaged_step_and_goes_on(tmp_path, cli):
    """Issue 13 item 11: the first damaged manifest ended `verify --all` (one line, no report of
    the other steps, no JSON)."""
    root = str(tmp_path / "run")
    _six_steps_five_damaged(root)
    report = cli.json("verify", root, "--all", expect=1)
    assert not report["ok"]
    status = {s["step"]: s["status"] for s in report["steps"]}
    assert status == {1: "ok", 2: "damaged", 3: "damaged", 4: "damaged", 5: "damaged", 6: "damaged"}
    kinds = {s["step"]: [p["kind"] for p in s["problems"]] for s in report["steps"]}
    assert kinds == {
        1: [],
        2: ["manifest"],
        3: ["checksum"],
        4: ["missing-object"],
        5: ["manifest"],
        6: ["manifest-missing"],
    }
    problems = {s["step"]: s["problems"] for s in report["steps"]}
    assert "not valid JSON" in problems[2][0]["message"] and "step-000000002" in problems[2][0]["message"]
    assert "not a complete manifest" in problems[5][0]["message"]
    assert "latest names it" in problems[6][0]["message"]
    assert problems[3][0]["fqn"] == "w" and problems[3][0]["chunk"] == "w/0.0"
    rc, out, err = cli("verify", root, "--all")
    lines = out.splitlines()
    assert rc == 1 and err == ""
    assert lines[0].startswith(f"step 1 {root}/step-000000001: OK")
    assert lines[-1] == "6 step(s) checked, 5 damaged: [2, 3, 4, 5, 6]"


@pytest.mark.timeout(60)
def test_inspect_names_a_damaged_step_and_shows_the_newest_that_reads(tmp_path, cli):
    """Issue 13 item 11: `inspect ROOT` stopped at a damaged newest manifest."""
    import torch

    from resilient import Checkpointer

    root = str(tmp_path / "run")
    ckpt = Checkpointer(root)
    for step in (1, 2):
        ckpt.save(step, {"w": torch.ones(4) * step}).wait()
    with open(os.path.join(root, "step-000000002", "manifest.json"), "r+") as f:
        f.truncate(20)
    summary = cli.json("inspect", root, expect=1)
    assert summary["step"] == 1 and summary["status"] == "ok"
    assert [(d["step"], d["kind"]) for d in summary["damaged"]] == [(2, "manifest")]
    rc, out, _ = cli("inspect", root)
    assert rc == 1 and out.splitlines()[0].startswith("! step 2 skipped, damaged: step 2: manifest ")
    assert out.splitlines()[1] == f"{root}/step-000000001"
    damaged = cli.json("inspect", root, "--step", "2", expect=1)
    assert (damaged["step"], damaged["status"], damaged["kind"]) == (2, "damaged", "manifest")
    rc, out, err = cli("inspect", root, "--step", "2")
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"resilient-ckpt: step 2: manifest {root}/step-000000002/manifest.json is not valid JSON")
