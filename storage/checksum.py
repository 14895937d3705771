"""crc32c of a concatenation from the crc32c of its pieces, without reading the bytes again.

A receipt records the crc32c of each region's raw bytes (verify checks it end to end), and the
shard writer has just computed the crc32c of every inner chunk. Where the chunks are consecutive
pieces of the region's bytes (chunks that span all but the first dimension, as FSDP's row shards
do), the region's crc32c follows from theirs: a second pass over the region, 8% of a 4-rank save's
writer samples here, is not needed. What that gives up: a crc taken from the staged region before
encoding would also catch an encoder that wrote the wrong slice; this one is as independent of the
encoder as the chunk crcs are (``test_localwrite`` holds the encoder to TensorStore's bytes, and
``test_checksum`` every combined crc to its tensor's bytes). Damage at rest and wrong reads are
caught as before: ``verify`` reads each region back through the reader and recomputes its crc.

The arithmetic is zlib's ``crc32_combine`` (``multmodp``/``x2nmodp`` of zlib 1.2.12+) with
crc32c's polynomial: appending ``n`` bytes multiplies the running crc by x^(8n) modulo the
polynomial, so ``crc(a + b) = crc(a) * x^(8 len(b)) ^ crc(b)``, in microseconds whatever the
length. The ``crc32c`` library has no combine; the tests check this one against it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

POLY = 0x82F63B78  # crc32c (Castagnoli), bit-reflected, as the crc32c library computes it
_TOP = 1 << 31  # x^0 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial, both reflected."""
    product, mask = 0, _TOP
    while True:
        if a & mask:
            product ^= b
            if a & (mask - 1) == 0:
                return product
        mask >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


MAX_NBYTES = 1 << 61
"""Longest piece combined: 8 * nbytes must stay below 2^64, the deepest entry of the table."""


def _x2n_table() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial for k = 0..63. Not zlib's 32 entries indexed ``k & 31``: that
    wrap relies on CRC-32's x^(2^32) = x; for crc32c's polynomial x^(2^31) = x, so a wrapped
    index is wrong for pieces of 2^29 bytes and more."""
    table, p = [], _TOP >> 1  # x^1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()


@functools.lru_cache(maxsize=1024)  # a save has few distinct chunk lengths
def _x8nmodp(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial."""
    if not 0 <= nbytes < MAX_NBYTES:
        raise ValueError(f"cannot combine a crc over {nbytes} bytes (0 .. 2^61 - 1)")
    p, k = _TOP, 3  # x^0; 8 = 2^3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k], p)
        nbytes >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, nbytes_b: int) -> int:
    """crc32c of ``a + b`` given crc32c(a), crc32c(b) and len(b)."""
    if crc_a == 0:  # the map is linear: 0 stays 0 (and the first piece needs no work)
        return crc_b
    return _multmodp(_x8nmodp(nbytes_b), crc_a) ^ crc_b


def crc32c_concat(pieces: Iterable[tuple[int, int]]) -> int:
    """crc32c of consecutive pieces, each given as (its crc32c, its length)."""
    crc = 0
    for piece_crc, nbytes in pieces:
        crc = crc32c_combine(crc, piece_crc, nbytes)
    return crc
