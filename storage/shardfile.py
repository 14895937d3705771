"""The shard object of our zarr v3 arrays, byte for byte (the ``sharding_indexed`` codec as
``arrays.array_metadata`` declares it), for the paths that write and read shards without
TensorStore.

A shard is the inner chunks of one outer chunk, each encoded as its raw little-endian bytes
followed by their crc32c (4 bytes, little-endian), then the index: per inner chunk, in C order of
the shard's chunk grid, ``(offset, nbytes)`` as two little-endian uint64 (``MISSING`` for both
when the chunk is absent), followed by the index's own crc32c. Inner chunks wholly outside the
array are absent; inner chunks cut by the array's edge are stored at full size, padded with the
fill value (zero), exactly as TensorStore and zarr-python write them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator

import crc32c
import numpy as np

from resilient.layout import Box

MISSING = 2**64 - 1
CRC_BYTES = 4


def chunk_key(shard_index: tuple[int, ...], *, format_version: int) -> str:
    """The shard's key under its array: zarr v3's "v2" chunk key encoding with a "." separator from
    format version 2 on (``1.0``; ``0`` for a 0-d array), its "default" one with "/" in version 1
    (``c/1/0``; ``c`` for a 0-d array)."""
    if format_version >= 2:
        return ".".join(map(str, shard_index)) or "0"
    return "c" + "".join(f"/{i}" for i in shard_index)


def chunks_per_shard(shard_shape: tuple[int, ...], inner_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s // i for s, i in zip(shard_shape, inner_shape, strict=True))


def index_nbytes(shard_shape: tuple[int, ...], inner_shape: tuple[int, ...]) -> int:
    return math.prod(chunks_per_shard(shard_shape, inner_shape)) * 16 + CRC_BYTES


def shards_in(box: Box, shard_shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """The shards a shard-aligned region covers: (grid index, the part of the shard inside ``box``).
    A region ends on the shard grid or at the array's edge, so that part is the shard's data."""
    lo = [o // s for o, s in zip(box.offsets, shard_shape, strict=True)]
    hi = [math.ceil((o + n) / s) for o, n, s in zip(box.offsets, box.sizes, shard_shape, strict=True)]
    for index in itertools.product(*(range(a, b) for a, b in zip(lo, hi, strict=True))):
        start = [i * s for i, s in zip(index, shard_shape, strict=True)]
        end = [min(st + s, o + n) for st, s, o, n in zip(start, shard_shape, box.offsets, box.sizes, strict=True)]
        yield tuple(index), Box(tuple(start), tuple(e - s for s, e in zip(start, end, strict=True)))


def crc_bytes(data) -> bytes:
    return crc32c.crc32c(data).to_bytes(CRC_BYTES, "little")


def _as_bytes(chunk: np.ndarray) -> np.ndarray:
    """The chunk's bytes as a flat uint8 view (a copy only when the chunk is not C-contiguous)."""
    return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)


@functools.lru_cache(maxsize=256)
def _one_chunk_index(chunk_nbytes: int) -> bytes:
    """The checksummed index of a shard holding one inner chunk of ``chunk_nbytes`` (crc included)."""
    index = np.array([[0, chunk_nbytes]], dtype="<u8").tobytes()
    return index + crc_bytes(index)


def encode_shard(
    data: np.ndarray,
    shard_shape: tuple[int, ...],
    inner_shape: tuple[int, ...],
    piece_crcs: list[tuple[int, int]] | None = None,
) -> list:
    """The shard object holding ``data`` (the shard's in-bounds part, shape <= ``shard_shape``) as a
    list of buffers to write back to back. Full inner chunks that are contiguous in ``data`` are
    views of its memory, not copies. ``piece_crcs``, if given, gets (crc32c, nbytes) of each present
    chunk's in-bounds bytes, in the order the chunks are stored (``checksum.crc32c_concat`` makes the
    crc32c of the whole from them where those bytes follow each other in ``data``)."""
    if data.shape == tuple(inner_shape) == tuple(shard_shape) and data.flags.c_contiguous:
        return _encode_one_chunk(data, piece_crcs)
    grid = chunks_per_shard(shard_shape, inner_shape)
    index = np.full((math.prod(grid), 2), MISSING, dtype="<u8")
    buffers: list = []
    offset = 0
    for n, chunk_index in enumerate(itertools.product(*(range(g) for g in grid))):
        start = [c * i for c, i in zip(chunk_index, inner_shape, strict=True)]
        stop = [min(s + i, d) for s, i, d in zip(start, inner_shape, data.shape, strict=True)]
        if any(s >= e for s, e in zip(start, stop, strict=True)):
            continue  # wholly outside the array: absent, as the readers expect
        piece = data[tuple(slice(s, e) for s, e in zip(start, stop, strict=True))] if grid else data
        in_bounds = piece
        if piece.shape != tuple(inner_shape):  # cut by the array's edge: pad with the fill value
            padded = np.zeros(inner_shape, dtype=data.dtype)
            padded[tuple(slice(0, e - s) for s, e in zip(start, stop, strict=True))] = piece
            piece = padded
        raw = _as_bytes(piece)
        crc = crc32c.crc32c(raw)
        buffers += [raw, crc.to_bytes(CRC_BYTES, "little")]
        if piece_crcs is not None:
            if in_bounds is piece:
                piece_crcs.append((crc, raw.nbytes))
            else:
                own = _as_bytes(in_bounds)
                piece_crcs.append((crc32c.crc32c(own), own.nbytes))
        index[n] = (offset, raw.nbytes + CRC_BYTES)
        offset += raw.nbytes + CRC_BYTES
    index_raw = index.tobytes()
    buffers += [index_raw, crc_bytes(index_raw)]
    return buffers


def _encode_one_chunk(data: np.ndarray, piece_crcs: list[tuple[int, int]] | None) -> list:
    """``encode_shard`` of a shard that is one whole inner chunk (most small tensors): the same
    bytes, without the general path's per-chunk bookkeeping (a save may hold thousands of these)."""
    raw = data.reshape(-1).view(np.uint8)
    crc = crc32c.crc32c(raw)
    if piece_crcs is not None:
        piece_crcs.append((crc, raw.nbytes))
    return [raw, crc.to_bytes(CRC_BYTES, "little") + _one_chunk_index(raw.nbytes + CRC_BYTES)]


def parse_index(tail: bytes | memoryview, shard_shape: tuple[int, ...], inner_shape: tuple[int, ...]) -> np.ndarray:
    """The shard's index, shape (chunks, 2) of (offset, nbytes), from its last ``index_nbytes``
    bytes; raises ValueError when the index's checksum does not match."""
    body, stored = tail[:-CRC_BYTES], bytes(tail[-CRC_BYTES:])
    if crc_bytes(body) != stored:
        raise ValueError("shard index checksum mismatch")
    return np.frombuffer(body, dtype="<u8").reshape(-1, 2)
