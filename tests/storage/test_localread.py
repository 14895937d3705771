"""The direct local read path: bit-identical with TensorStore's reads, and every kind of damage
(flipped byte, bad index, truncation, absent chunk, deleted shard) an IntegrityError naming it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from resilient import Checkpointer, IntegrityError, StorageError
from resilient.dtypes import torch_dtype
from resilient.layout import Box
from resilient.manifest import MANIFEST, ArrayEntry, Manifest, step_dir
from resilient.storage import localread
from resilient.storage.arrays import array_metadata, make_context, open_array
from resilient.storage.reader import ReadTarget, read_into, read_tensorstore
from resilient.storage.shardfile import CRC_BYTES, MISSING, crc_bytes, index_nbytes
from resilient.storage.url import parse_url

pytestmark = pytest.mark.timeout(120)

ATTEMPT = "step-000000001/attempt-x"
BUDGET = 64 << 20


def _random_tensor(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.rand(shape, generator=g) > 0.5
    if dtype.startswith("int"):
        return torch.randint(-(2**40), 2**40, shape, generator=g).to(torch_dtype(dtype))
    return torch.randn(shape, generator=g).to(torch_dtype(dtype))


def _write(
    root: Path, data: torch.Tensor, dtype: str, shard: tuple[int, ...], inner: tuple[int, ...], version: int = 2
):
    """Write ``data`` as one zarr array through TensorStore (the writer of real checkpoints), with
    the shard keys of format ``version``."""
    location = parse_url(str(root))
    shape = list(data.shape)
    meta = array_metadata(shape, dtype, list(shard), list(inner), format_version=version)
    store = open_array(location, f"{ATTEMPT}/x", meta, make_context(location)).result()
    from resilient.dtypes import to_numpy

    store.write(to_numpy(data)).result()
    entry = ArrayEntry("x", "x", shape, dtype, list(shard), list(inner), data.nbytes, [], [], [], [], version)
    return location, entry


def _read(location, entry: ArrayEntry, box: Box, *, direct: bool) -> torch.Tensor:
    dest = (
        torch.full(box.sizes, 7, dtype=torch_dtype(entry.dtype))
        if box.sizes
        else torch.zeros((), dtype=torch_dtype(entry.dtype))
    )
    target = ReadTarget(entry, box, dest)
    if direct:
        assert localread.can_read_locally(location, dest, entry.dtype)
        got = localread.read_local(location, ATTEMPT, [target], step=1, budget_bytes=BUDGET)
        n = got.needed
        assert got.fetched >= got.needed  # whole inner chunks and the shard's index
    else:
        n = read_tensorstore(location, ATTEMPT, [target], make_context(location), step=1, budget_bytes=BUDGET)
    assert n == dest.nbytes
    return dest


def _random_boxes(shape: tuple[int, ...], count: int, seed: int) -> list[Box]:
    rng = random.Random(seed)
    boxes = []
    for _ in range(count):
        lo = [rng.randrange(n) for n in shape]
        boxes.append(Box(tuple(lo), tuple(rng.randint(1, n - o) for o, n in zip(lo, shape, strict=True))))
    return boxes


def _reshard_boxes(shape: tuple[int, ...], parts: int) -> list[Box]:
    """The dim-0 boxes of ``parts`` FSDP ranks (torch.chunk sizes: ceil, last one short)."""
    step = -(-shape[0] // parts)
    return [Box((o, *[0] * (len(shape) - 1)), (min(step, shape[0] - o), *shape[1:])) for o in range(0, shape[0], step)]


CASES = [
    # shape, dtype, shard shape, inner shape: edge shards, padded edge chunks, grids on 1..3 dims
    ((1000, 24), "float32", (256, 24), (64, 24)),
    ((10, 12, 8), "bfloat16", (5, 6, 8), (5, 3, 4)),
    ((1001,), "int64", (300,), (100,)),
    ((37, 5), "bool", (20, 5), (10, 5)),
    ((64, 64), "float16", (64, 64), (64, 16)),
    ((9, 7, 5), "int32", (4, 7, 5), (2, 7, 5)),
]


@pytest.mark.parametrize("version", [1, 2], ids=["format_v1", "format_v2"])
@pytest.mark.parametrize(("shape", "dtype", "shard", "inner"), CASES, ids=[c[1] for c in CASES])
def test_equals_tensorstore_for_many_boxes(tmp_path, shape, dtype, shard, inner, version):
    data = _random_tensor(shape, dtype, seed=len(shape))
    location, entry = _write(tmp_path, data, dtype, shard, inner, version)
    boxes = [Box((0,) * len(shape), shape), *_random_boxes(shape, 25, seed=3)]
    boxes += [b for parts in (2, 3, 5) for b in _reshard_boxes(shape, parts)]
    for box in boxes:
        ours = _read(location, entry, box, direct=True)
        theirs = _read(location, entry, box, direct=False)
        assert torch.equal(ours, theirs), box
        assert torch.equal(ours, data[box.slices()]), box


@pytest.mark.parametrize("version", [1, 2], ids=["format_v1", "format_v2"])
def test_zero_dim_array(tmp_path, version):
    data = torch.tensor(3.25)
    location, entry = _write(tmp_path, data, "float32", (), (), version)
    ours = _read(location, entry, Box((), ()), direct=True)
    assert ours.shape == () and ours.item() == 3.25


def test_many_small_chunks_split_into_preadv_calls_and_tasks(tmp_path, monkeypatch):
    """1000 inner chunks in one shard: more than one preadv can take (IOV_MAX), many tasks, a
    scratch budget smaller than the partial chunks need at once."""
    monkeypatch.setattr(localread, "TASK_BYTES", 4096)
    data = _random_tensor((2000, 4), "float32", seed=1)
    location, entry = _write(tmp_path, data, "float32", (2000, 4), (2, 4))
    for box in [Box((0, 0), (2000, 4)), Box((1, 0), (1997, 4)), Box((3, 1), (1500, 2))]:
        dest = torch.zeros(box.sizes)
        localread.read_local(location, ATTEMPT, [ReadTarget(entry, box, dest)], step=1, budget_bytes=64, threads=3)
        assert torch.equal(dest, data[box.slices()])


def test_read_into_routes_strided_destinations_and_conversions_to_tensorstore(tmp_path, monkeypatch):
    data = _random_tensor((40, 30), "float32", seed=2)
    location, entry = _write(tmp_path, data, "float32", (20, 30), (10, 30))
    strided = torch.zeros(30, 40).t()  # shape (40, 30), not contiguous
    dense = torch.zeros(40, 30)
    calls = []
    real = localread.read_local
    monkeypatch.setattr("resilient.storage.reader.read_local", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    box = Box((0, 0), (40, 30))
    targets = [ReadTarget(entry, box, strided), ReadTarget(entry, box, dense)]
    assert read_into(location, ATTEMPT, targets, make_context(location), step=1, budget_bytes=BUDGET).needed == 2 * (
        data.nbytes
    )
    assert calls == [1]  # only the dense one took the direct path
    assert torch.equal(strided, data) and torch.equal(dense, data)
    assert not localread.can_read_locally(parse_url("memory://m/x"), dense, "float32")
    assert not localread.can_read_locally(location, dense, "float64")


# ---------------------------------------------------------------------------------------------
# damage


def _shard_file(root: Path, key: str) -> Path:
    return root / ATTEMPT / "x" / key


def _index(path: Path, shard: tuple[int, ...], inner: tuple[int, ...]) -> np.ndarray:
    tail = path.read_bytes()[-index_nbytes(shard, inner) :]
    return np.frombuffer(tail[:-CRC_BYTES], dtype="<u8").reshape(-1, 2).copy()


SHAPE, SHARD, INNER = (100, 8), (50, 8), (10, 8)


@pytest.fixture
def written(tmp_path):
    data = _random_tensor(SHAPE, "float32", seed=5)
    location, entry = _write(tmp_path, data, "float32", SHARD, INNER)
    return tmp_path, location, entry, data


def test_flipped_byte_names_inner_chunk_and_shard(written):
    root, location, entry, data = written
    path = _shard_file(root, "1.0")
    offset, _ = _index(path, SHARD, INNER)[2]
    raw = bytearray(path.read_bytes())
    raw[int(offset) + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as info:
        _read(location, entry, Box((0, 0), SHAPE), direct=True)
    msg = str(info.value)
    assert "checksum mismatch in tensor 'x' at step 1" in msg
    assert "inner chunk {2, 0} of shard object '1.0'" in msg and str(path) in msg
    # a box that does not touch the damaged chunk still loads, and a partial read of it fails
    assert torch.equal(_read(location, entry, Box((0, 0), (70, 8)), direct=True), data[:70])
    with pytest.raises(IntegrityError, match=r"inner chunk \{2, 0\}"):
        _read(location, entry, Box((71, 2), (1, 3)), direct=True)


def test_flipped_crc_byte_is_caught(written):
    root, location, entry, _ = written
    path = _shard_file(root, "0.0")
    offset, nbytes = _index(path, SHARD, INNER)[0]
    raw = bytearray(path.read_bytes())
    raw[int(offset + nbytes) - 1] ^= 0x80
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"inner chunk \{0, 0\} of shard object '0.0'"):
        _read(location, entry, Box((0, 0), (5, 8)), direct=True)


def test_damaged_index_is_an_integrity_error(written):
    root, location, entry, _ = written
    path = _shard_file(root, "0.0")
    raw = bytearray(path.read_bytes())
    raw[-CRC_BYTES - 3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"checksum mismatch .* the index of shard object '0.0'"):
        _read(location, entry, Box((0, 0), (10, 8)), direct=True)


def test_truncated_shard_is_an_integrity_error(written):
    root, location, entry, _ = written
    path = _shard_file(root, "1.0")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(IntegrityError, match=r"tensor 'x' at step 1\b.*shard object '1.0'"):
        _read(location, entry, Box((50, 0), (50, 8)), direct=True)
    path.write_bytes(raw[:10])  # shorter than the index itself
    with pytest.raises(IntegrityError, match=r"shorter than its index"):
        _read(location, entry, Box((50, 0), (50, 8)), direct=True)


def test_index_pointing_past_the_data_or_absent_chunk(written):
    root, location, entry, _ = written
    path = _shard_file(root, "0.0")
    raw = path.read_bytes()
    body_len = len(raw) - index_nbytes(SHARD, INNER)
    rows = [
        ((MISSING, MISSING), "is missing data: inner chunk {3, 0}"),
        ((body_len - 100, 324), "is damaged: inner chunk {3, 0} .* has index entry"),  # runs into the index
        ((0, 100), "is damaged: inner chunk {3, 0} .* has index entry"),  # not the chunk's size
    ]
    for row, problem in rows:
        index = _index(path, SHARD, INNER)
        index[3] = row
        body = index.astype("<u8").tobytes()
        path.write_bytes(raw[:body_len] + body + crc_bytes(body))
        with pytest.raises(IntegrityError, match=problem.replace("{", r"\{").replace("}", r"\}")):
            _read(location, entry, Box((0, 0), (50, 8)), direct=True)


def test_deleted_shard_is_missing_data(written):
    root, location, entry, data = written
    os.remove(_shard_file(root, "1.0"))
    with pytest.raises(IntegrityError, match=r"tensor 'x' at step 1 is missing data: shard object '1.0'"):
        _read(location, entry, Box((40, 0), (20, 8)), direct=True)
    assert torch.equal(_read(location, entry, Box((0, 0), (50, 8)), direct=True), data[:50])


def test_unreadable_shard_is_a_storage_error(written):
    root, location, entry, _ = written
    path = _shard_file(root, "1.0")
    os.remove(path)
    os.mkdir(path)  # opens, but cannot be read as a file
    with pytest.raises(StorageError) as info:
        _read(location, entry, Box((50, 0), (50, 8)), direct=True)
    assert "'x'" in str(info.value) and "1.0" in str(info.value)


# ---------------------------------------------------------------------------------------------
# checkpoints written by the Checkpointer


def test_checkpointer_save_loads_through_the_direct_path(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(300, 70, generator=g),
        "b": torch.randn(70, generator=g).to(torch.bfloat16),
        "mask": torch.rand(33, generator=g) > 0.5,
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "scalar": torch.tensor(2.5),
    }
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state).wait()

    def no_tensorstore(*args, **kwargs):
        raise AssertionError("a local load into dense CPU tensors must not go through TensorStore")

    monkeypatch.setattr("resilient.storage.reader.read_tensorstore", no_tensorstore)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ckpt.load(target) == 1
    for k in state:
        assert torch.equal(target[k], state[k]), k
    # boxes of another world size, read from the TensorStore-written shards
    manifest = Manifest.loads((tmp_path / step_dir(1) / MANIFEST).read_bytes(), where="test")
    location = parse_url(str(tmp_path))
    attempt_key = f"{step_dir(1)}/{manifest.attempt}"
    for box in _reshard_boxes((300, 70), 3) + _random_boxes((300, 70), 10, seed=9):
        dest = torch.empty(box.sizes)
        target = ReadTarget(manifest.arrays["w"], box, dest)
        localread.read_local(location, attempt_key, [target], step=1, budget_bytes=BUDGET)
        assert torch.equal(dest, state["w"][box.slices()]), box


def test_a_chunk_that_fails_its_checksum_leaves_no_damaged_bytes_in_the_destination(written):
    """Review finding: preadv lands bytes in the live tensor before the crc check; on a mismatch
    they were left there. Now the run's direct spans are zeroed (the fill value) before raising."""
    root, location, entry, data = written
    path = _shard_file(root, "0.0")
    offset, _ = _index(path, SHARD, INNER)[1]
    raw = bytearray(path.read_bytes())
    raw[int(offset) + 9] ^= 0x40
    path.write_bytes(bytes(raw))
    dest = torch.full((50, 8), 7.0)
    with pytest.raises(IntegrityError):
        localread.read_local(
            location, ATTEMPT, [ReadTarget(entry, Box((0, 0), (50, 8)), dest)], step=1, budget_bytes=BUDGET
        )
    damaged_rows = dest[10:20]
    assert torch.equal(damaged_rows, torch.zeros(10, 8)), "unverified bytes left in the destination"
    assert not any(torch.equal(dest[r], data[r]) and not torch.equal(data[r], torch.zeros(8)) for r in range(10, 20))


@pytest.mark.timeout(90)
def test_a_load_at_interpreter_exit_reads_through_the_direct_path(tmp_path):
    # Loads may run in atexit handlers (an emergency restore, a tool's cleanup), where a
    # ThreadPoolExecutor refuses new work: the direct path uses plain threads.
    script = f"""
import atexit, torch
from resilient import Checkpointer

def load_at_exit():
    state = {{"w": torch.zeros(64, 1024)}}
    Checkpointer({str(tmp_path)!r}).load(state)
    print("loaded", float(state["w"].sum()))

with Checkpointer({str(tmp_path)!r}) as ckpt:
    ckpt.save(1, {{"w": torch.ones(64, 1024)}}).wait(60)
atexit.register(load_at_exit)
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0 and done.stdout.strip() == f"loaded {64.0 * 1024}", done.stdout + done.stderr[-2000:]
