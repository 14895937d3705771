"""The many-small-tensors paths of format version 3 give what the general paths give: whole small
tensors read in runs of a pack (``packread``) load the same values as the per-shard reader and
check every crc32c before a byte lands; zarr.json documents from templates are ``json.dumps``'s
bytes; the writev pieces of thousands of buffers hold the same bytes; a one-process manifest built
beside the pack write is the one built after it, and what that build finds fails the save."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from resilient import Checkpointer, IntegrityError
from resilient.layout import ArrayPlan
from resilient.storage import localread, localwrite, packread
from resilient.storage.arrays import plan_metadata, zarr_array_document, zarr_group_document
from resilient.storage.localwrite import AttemptFiles
from resilient.storage.persist import zarr_documents

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(700, 512, generator=g),  # 1.4 MiB: two inner chunks, the general path
        "norms": {f"n{i}": torch.randn(33, generator=g) for i in range(40)},
        "half": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "flag": torch.rand(9, generator=g) > 0.5,
        "scale": torch.tensor(2.5),
        "tail": torch.randn(8, 3, generator=g),
    }


def _zeros(state: dict) -> dict:
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def _equal(a: dict, b: dict) -> bool:
    return all(_equal(v, b[k]) if isinstance(v, dict) else torch.equal(v, b[k]) for k, v in a.items())


def test_whole_small_tensors_load_as_the_per_shard_reader_loads_them(tmp_path, monkeypatch):
    state = _state()
    runs: list[int] = []
    real_run = packread._read_run
    monkeypatch.setattr(packread, "_read_run", lambda run, *a: (runs.append(len(run)), real_run(run, *a))[1])
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
        fast = _zeros(state)
        ckpt.load(fast)
        assert sum(runs) == 44 and len(runs) <= 2  # every tensor but "big", read in a run or two
        monkeypatch.setattr(localread, "is_whole_small", lambda target, cap: False)
        general = _zeros(state)
        ckpt.load(general)
    assert _equal(fast, state) and _equal(general, state)


def test_runs_are_cut_at_the_cap_and_at_gaps(tmp_path, monkeypatch):
    state = {f"n{i}": torch.full((256,), float(i)) for i in range(30)}  # 1 KiB shards
    runs: list[int] = []
    real_run = packread._read_run
    monkeypatch.setattr(packread, "_read_run", lambda run, *a: (runs.append(len(run)), real_run(run, *a))[1])
    monkeypatch.setattr(localread, "TASK_BYTES", 4 << 10)  # a run holds 3 of them at most
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
        back = _zeros(state)
        ckpt.load(back)
    assert _equal(back, state)
    assert sum(runs) == 30 and max(runs) == 3


def _one_small(tmp_path) -> tuple[Checkpointer, dict, dict, bytearray, str]:
    state = {"a": torch.arange(64, dtype=torch.float32), "b": torch.full((16,), 7.0)}
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state).wait()
    manifest = json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
    pack, offset, nbytes = manifest["arrays"]["b"]["shards"]["0"]
    (path,) = (tmp_path / "step-000000001").glob(f"attempt-*/{pack}")
    return ckpt, state, {"offset": offset, "nbytes": nbytes}, bytearray(path.read_bytes()), str(path)


@pytest.mark.parametrize(
    "where,problem",
    [
        (
            lambda ref: ref["offset"] + 3,
            r"checksum mismatch in tensor 'b' at step 1, inner chunk \{0\} of shard object '0'",
        ),
        (
            lambda ref: ref["offset"] + 64 + 1,
            r"checksum mismatch in tensor 'b' at step 1, inner chunk \{0\}",
        ),  # its crc
        (lambda ref: ref["offset"] + ref["nbytes"] - 10, r"checksum mismatch .* the index of shard object '0'"),
    ],
    ids=["data", "chunk crc", "index"],
)
def test_a_damaged_small_tensor_is_caught_before_it_lands(tmp_path, where, problem):
    ckpt, state, ref, data, path = _one_small(tmp_path)
    data[where(ref)] ^= 0x20
    with open(path, "wb") as f:
        f.write(data)
    dest = {"a": torch.zeros(64), "b": torch.full((16,), -1.0)}
    with pytest.raises(IntegrityError, match=problem):
        ckpt.load(dest)
    assert torch.equal(dest["b"], torch.full((16,), -1.0))  # checked in scratch: nothing landed


def test_an_index_naming_another_chunk_size_is_damage(tmp_path):
    from resilient.storage.shardfile import crc_bytes

    ckpt, _, ref, data, path = _one_small(tmp_path)
    end = ref["offset"] + ref["nbytes"]
    index = np.array([[0, 12]], dtype="<u8").tobytes()  # 8 bytes + crc, not 64 + crc
    data[end - 20 : end] = index + crc_bytes(index)
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(IntegrityError, match=r"'b' at step 1 is damaged: inner chunk \{0\} .* has index entry"):
        ckpt.load({"a": torch.zeros(64), "b": torch.zeros(16)})


def test_a_pack_cut_inside_a_run_names_the_shard_and_the_pack(tmp_path):
    ckpt, _, ref, data, path = _one_small(tmp_path)
    with open(path, "wb") as f:
        f.write(data[: ref["offset"] + 10])
    with pytest.raises(IntegrityError, match=r"'b' at step 1 is damaged: shard object '0' .* cut short.*'a', 'b'"):
        ckpt.load({"a": torch.zeros(64), "b": torch.zeros(16)})
    os.remove(path)
    with pytest.raises(IntegrityError, match=r"at step 1 is missing data: .*pack that does not exist"):
        ckpt.load({"a": torch.zeros(64), "b": torch.zeros(16)})


def _plan(fqn: str, shape: tuple, dtype: str = "float32") -> ArrayPlan:
    return ArrayPlan(fqn, shape, dtype, shape, shape, (), (), ())


def test_zarr_documents_are_json_dumps_of_the_documents():
    plans = {
        fqn: _plan(fqn, shape, dtype)
        for fqn, shape, dtype in [
            ("model.layers.0.norm", (16,), "float32"),
            ("model.layers.1.norm", (16,), "float32"),  # the same kind: the shared head
            ("model.emb", (4, 8), "bfloat16"),
            ('odd."name"\\ü', (), "bool"),
            ("flag", (3,), "bool"),
        ]
    }
    got = zarr_documents(plans, 9)
    want = {"zarr.json": zarr_group_document({"resilient_step": 9})}
    for fqn, plan in plans.items():
        parts = fqn.split(".")
        for depth in range(1, len(parts)):
            want.setdefault("/".join(parts[:depth]) + "/zarr.json", zarr_group_document())
        want["/".join(parts) + "/zarr.json"] = zarr_array_document(plan_metadata(plan), {"fqn": fqn})
    assert list(got) == list(want)  # the same keys in the same order: the pack's layout
    assert got == {k: json.dumps(v).encode() for k, v in want.items()}
    arrays = {fqn.replace(".", "/") + "/zarr.json" for fqn in plans}
    assert zarr_documents(plans, 9, groups=False) == {k: v for k, v in got.items() if k in arrays}


@pytest.mark.parametrize("threads", [1, 3])
def test_thousands_of_buffers_write_the_same_bytes(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(localwrite, "WRITEBACK_STEP_BYTES", 1000)  # many pieces, buffers split between them
    rng = np.random.default_rng(1)
    buffers = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, 700, 3 * localwrite.IOV_MAX)]
    buffers += [bytes(b) for b in buffers[:50]] + [memoryview(np.arange(30, dtype=np.int32))]
    files = AttemptFiles(str(tmp_path), expected_files=1)
    want = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    assert files.write("obj", buffers, threads=threads) == len(want)
    files.close()
    assert (tmp_path / "obj").read_bytes() == want


def test_a_coverage_gap_found_at_the_commit_fails_the_save_and_keeps_the_last_step(tmp_path, monkeypatch):
    from resilient.errors import CommitError
    from resilient.storage import commit

    state = {"w": torch.ones(4)}
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()

        def uncovered(plans, receipts, step):
            raise CommitError(f"step {step} not committed: injected coverage gap")

        monkeypatch.setattr(commit, "check_coverage", uncovered)
        with pytest.raises(CommitError, match="injected coverage gap"):
            ckpt.save(2, {"w": torch.full((4,), 2.0)}).wait()
        assert ckpt.steps() == [1]
        (attempt,) = (tmp_path / "step-000000002").glob("attempt-*")
        assert (attempt / "failures" / "rank--0001.json").exists()  # the coordinator's decision
        back = {"w": torch.zeros(4)}
        assert ckpt.load(back) == 1 and torch.equal(back["w"], torch.ones(4))
