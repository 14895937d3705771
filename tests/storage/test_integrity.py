"""Corrupted, truncated or missing chunks: load names the tensor, step and chunk; other steps load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from resilient import Checkpointer, IntegrityError

pytestmark = pytest.mark.timeout(60)


def _shard_range(root, step: int, fqn: str, key: str = "0") -> tuple[Path, int, int]:
    """(pack file, offset, length) of one shard object of a format-version-3 step."""
    manifest = json.loads((Path(root) / f"step-{step:09d}" / "manifest.json").read_text())
    pack, offset, nbytes = manifest["arrays"][fqn]["shards"][key]
    return Path(root) / f"step-{step:09d}" / manifest["attempt"] / pack, offset, nbytes


def _save_two_steps(root) -> tuple[Checkpointer, dict, dict]:
    ckpt = Checkpointer(str(root), config=None)
    s1 = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "v": torch.ones(8)}
    s2 = {"w": s1["w"] + 1, "v": s1["v"] * 2}
    ckpt.save(1, s1).wait()
    ckpt.save(2, s2).wait()
    return ckpt, s1, s2


def test_flipped_byte_names_tensor_step_and_chunk(tmp_path):
    ckpt, s1, _ = _save_two_steps(tmp_path)
    pack, offset, _ = _shard_range(tmp_path, 2, "w", "0.0")
    data = bytearray(pack.read_bytes())
    data[offset + 100] ^= 0xFF
    pack.write_bytes(bytes(data))
    target = {"w": torch.zeros(64, 64), "v": torch.zeros(8)}
    with pytest.raises(IntegrityError) as info:
        ckpt.load(target)
    msg = str(info.value)
    assert "'w'" in msg and "step 2" in msg and "inner chunk {0, 0}" in msg and "shard object '0.0'" in msg
    assert ckpt.load(target, step=1) == 1  # the other step still loads, exactly
    assert torch.equal(target["w"], s1["w"]) and torch.equal(target["v"], s1["v"])


def test_truncated_and_missing_pack_objects_are_integrity_errors(tmp_path):
    ckpt, _, _ = _save_two_steps(tmp_path)
    pack, offset, nbytes = _shard_range(tmp_path, 2, "w", "0.0")
    pack.write_bytes(pack.read_bytes()[: offset + nbytes // 2])
    target = {"w": torch.zeros(64, 64), "v": torch.zeros(8)}
    with pytest.raises(IntegrityError, match=r"at step 2 is damaged: .* cut short.*holds tensors 'v', 'w'"):
        ckpt.load(target)
    pack, _, _ = _shard_range(tmp_path, 1, "v")
    os.remove(pack)
    with pytest.raises(IntegrityError, match=r"at step 1 is missing data.*holds tensors 'v', 'w'"):
        ckpt.load(target, step=1)


def test_an_empty_manifest_is_an_integrity_error(tmp_path):
    # One process parses the bytes it read (no round trip through the agreement): zero bytes
    # are a damaged manifest, not "nothing read" (an AttributeError once).
    ckpt, _, _ = _save_two_steps(tmp_path)
    (tmp_path / "step-000000002" / "manifest.json").write_bytes(b"")
    with pytest.raises(IntegrityError, match="manifest .*step-000000002.* is not valid JSON"):
        ckpt.load({"w": torch.zeros(64, 64), "v": torch.zeros(8)}, step=2)


def test_damaged_manifest_is_an_integrity_error(tmp_path):
    ckpt, _, _ = _save_two_steps(tmp_path)
    (tmp_path / "step-000000002" / "manifest.json").write_text("{not json")
    with pytest.raises(IntegrityError, match="manifest .*step-000000002.* is not valid JSON"):
        ckpt.load({"w": torch.zeros(64, 64), "v": torch.zeros(8)})
