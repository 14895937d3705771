"""A region's crc32c made from its chunks' crcs (``storage/checksum.py``) is the crc32c of its
bytes: for the combine itself, and for every region a save records, whether the writer combined
the chunk crcs (row bands) or read the bytes again (any other chunking)."""

from __future__ import annotations

import os
import random

import crc32c
import numpy as np
import pytest
import torch

from resilient import Checkpointer
from resilient.manifest import MANIFEST, Manifest, step_dir
from resilient.storage import checksum, persist
from resilient.storage.checksum import crc32c_combine, crc32c_concat
from resilient.storage.config import CheckpointerConfig

pytestmark = pytest.mark.timeout(120)


def test_concat_of_piece_crcs_is_the_crc_of_the_whole():
    rng = random.Random(0)
    for _ in range(300):
        parts = [os.urandom(rng.choice([0, 1, 3, 4, 17, 1000, 4096, 65537])) for _ in range(rng.randint(0, 6))]
        want = crc32c.crc32c(b"".join(parts))
        assert crc32c_concat((crc32c.crc32c(p), len(p)) for p in parts) == want, [len(p) for p in parts]
    assert crc32c_combine(0x12345678, 0, 0) == 0x12345678  # appending nothing changes nothing


def test_combine_is_exact_for_pieces_past_half_a_gib():
    """x^(8(m+n)) = x^(8m) x^(8n): a table entry gone wrong at 2^29 bytes and more (zlib's k & 31
    wrap is only right for CRC-32's polynomial) breaks the identity; fails on the wrapped index.
    (Checked once by hand against the crc32c library's crc of 2^29 + 5 zero bytes: 7 s, not here.)"""
    for m, n in [(2**28, 2**28), (2**30, 2**30), (2**31, 3), (2**40 + 7, 2**33 + 1), (2**60, 2**60 - 1)]:
        assert checksum._x8nmodp(m + n) == checksum._multmodp(checksum._x8nmodp(m), checksum._x8nmodp(n)), (m, n)
    with pytest.raises(ValueError, match="2\\^61"):
        crc32c_combine(1, 0, 2**61)


SHAPES = {
    "rows_over_2_shards_cut_at_the_edge": ((3001, 100), torch.float32),
    "rows_in_one_shard_cut_at_the_edge": ((1000, 100), torch.float32),
    "one_dim_cut_at_the_edge": ((100_003,), torch.float32),
    "three_dims": ((50, 30, 20), torch.float32),
    "bf16_rows": ((2049, 77), torch.bfloat16),
    "zero_dims": ((), torch.float32),
    "columns_split_read_again": ((2, 40_000), torch.float32),
    "one_small_chunk": ((7,), torch.float32),
}


def test_every_recorded_region_crc_is_the_crc_of_its_bytes(tmp_path, monkeypatch):
    combined: list[bool] = []
    real = persist._crc_from_chunks
    monkeypatch.setattr(persist, "_crc_from_chunks", lambda item: combined.append(real(item)) or combined[-1])
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=gen).to(dtype) for name, (shape, dtype) in SHAPES.items()}
    # small chunks and shards: several inner chunks per shard, several shards, edges cut
    config = CheckpointerConfig(inner_chunk_bytes=64 << 10, max_shard_bytes=1 << 20)
    with Checkpointer(str(tmp_path), config=config) as ckpt:
        ckpt.save(1, state).wait()
    assert True in combined and False in combined, "both ways were taken"
    manifest = Manifest.loads((tmp_path / step_dir(1) / MANIFEST).read_bytes(), where="test")
    for fqn, tensor in state.items():
        (region,) = manifest.arrays[fqn].regions
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        want = crc32c.crc32c(np.ascontiguousarray(raw.numpy()).reshape(-1).view(np.uint8))
        assert region["crc32c"] == want, fqn
    assert len(manifest.arrays["rows_over_2_shards_cut_at_the_edge"].regions) == 1
