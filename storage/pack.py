"""Pack objects (format version 3): one rank's shard objects of a save, back to back in a few
large objects, so that a step's object count does not grow with its tensor count.

A pack is a stored (uncompressed) ZIP archive. Each entry is one zarr shard object, byte for byte
what version 2 wrote as its own file (``shardfile``), named by its key under the attempt
(``<array path>/<chunk key>``); rank 0's first pack also holds every ``zarr.json``, every other
rank's first pack those of the arrays it writes. Why ZIP: a
standard reader opens it without our code (TensorStore's ``zip`` kvstore, stacked per array with
``kvstack``; Python's ``zipfile``; ``unzip``), and a stored entry's bytes are one contiguous range
of the object, so our own reader goes straight to them with ranged reads: the manifest records
each shard's (pack, offset, length) and nothing is listed or parsed at load time.

The format's limits are kept below ZIP64's: a pack ends before ``PACK_MAX_BYTES`` of entries or
``PACK_MAX_ENTRIES`` entries, and another one starts (a shard is at most ``max_shard_bytes``,
1 GiB by default and never over 2 GiB, so each full pack holds more than 2 GiB with the default: at
most 3 packs per 4 GiB a rank writes; an entry that does not fit a pack alone is refused).
Each entry carries the CRC-32 ZIP requires (ISA-L's: as fast as crc32c, where zlib's would slow a
big save; benchmarks/README.md, "Choices in the code"); the checkpoint's own integrity check
stays the crc32c of every inner chunk and shard index.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from resilient.storage.parallel import run_parallel

try:  # ISA-L's CRC-32, several times zlib's (benchmarks/README.md, "Choices in the code")
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32 as _crc32

PACK_MAX_BYTES = 3 << 30
"""A pack ends before this many bytes of entries: offsets stay below ZIP's 4 GiB (no ZIP64)."""
PACK_MAX_ENTRIES = 65_000
"""ZIP's entry count is 16 bits (65,535) without ZIP64."""
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes + name
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes + name
_END = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_VERSION = 20  # 2.0: stored entries
_UTF8_NAMES = 0x0800  # general purpose flag bit 11: names are UTF-8 (FQNs may be)
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01: a pack's content does not depend on the clock
CRC_TASK_BYTES = 16 << 20
JOIN_BELOW_BYTES = 4096
"""Buffers smaller than this are copied together into one buffer of the pack's write list."""


def pack_name(rank: int, index: int) -> str:
    """The key of a rank's ``index``-th pack under the attempt."""
    return f"pack-r{rank:05d}-{index}.zip"


@dataclass(slots=True)
class Entry:
    name: bytes
    buffers: list
    nbytes: int
    header_offset: int
    crc: int = 0


@dataclass(slots=True)
class Pack:
    """One pack being laid out: its entries and its size so far."""

    key: str
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0

    def buffers(self) -> list:
        """The whole object: each entry's local header and bytes, then the central directory.
        Runs of buffers under ``JOIN_BELOW_BYTES`` (headers, crcs, shard indexes, zarr.json) come
        joined into one: a pack of thousands of small tensors is then a few thousand buffers to
        write, not five per tensor."""
        out: list = []
        small: list = []
        for e in self.entries:
            small += self.header_of(e)
            for b in e.buffers:
                if nbytes_of(b) < JOIN_BELOW_BYTES:
                    small.append(b)
                    continue
                if small:
                    out.append(b"".join(small))
                    small = []
                out.append(b)
        out.append(b"".join(small + self.tail()))
        return out

    @staticmethod
    def header_of(e: Entry) -> list:
        """The entry's local file header (its CRC-32 must be known)."""
        sizes = (e.crc, e.nbytes, e.nbytes, len(e.name))
        return [_LOCAL.pack(0x04034B50, _VERSION, _UTF8_NAMES, 0, 0, _DOS_DATE, *sizes, 0), e.name]

    def tail(self) -> list:
        """The central directory and its end record, which close the archive."""
        central = []
        for e in self.entries:
            head = (0x02014B50, _VERSION, _VERSION, _UTF8_NAMES, 0, 0, _DOS_DATE, e.crc, e.nbytes, e.nbytes)
            central.append(_CENTRAL.pack(*head, len(e.name), 0, 0, 0, 0, 0, e.header_offset) + e.name)
        directory = b"".join(central)
        n = len(self.entries)
        return [directory, _END.pack(0x06054B50, 0, 0, n, n, len(directory), self.nbytes, 0)]


@dataclass(frozen=True, slots=True)
class Ref:
    """Where an entry's bytes are: ``nbytes`` from ``offset`` of the pack object ``pack``."""

    pack: str
    offset: int
    nbytes: int

    def to_json(self) -> list:
        return [self.pack, self.offset, self.nbytes]


class PackBuilder:
    """Lays entries out into packs as they are added; ``finish`` makes them writable objects."""

    def __init__(self, name_of: Callable[[int], str]) -> None:
        self._name_of = name_of
        self.packs: list[Pack] = []

    def add(self, name: str, buffers: list) -> Ref:
        """Add an entry holding ``buffers`` back to back; returns where its bytes will be."""
        raw = name.encode()
        nbytes = sum(nbytes_of(b) for b in buffers)
        if _LOCAL.size + len(raw) + nbytes > PACK_MAX_BYTES:  # not even alone: ZIP sizes are 32-bit
            raise ValueError(
                f"entry {name!r} of {nbytes} bytes does not fit a pack ({PACK_MAX_BYTES} bytes): lower max_shard_bytes"
            )
        pack = self.packs[-1] if self.packs else None
        if pack is None or pack.nbytes + nbytes > PACK_MAX_BYTES or len(pack.entries) >= PACK_MAX_ENTRIES:
            pack = Pack(self._name_of(len(self.packs)))
            self.packs.append(pack)
        entry = Entry(raw, buffers, nbytes, pack.nbytes)
        pack.entries.append(entry)
        pack.nbytes += _LOCAL.size + len(raw) + nbytes
        return Ref(pack.key, entry.header_offset + _LOCAL.size + len(raw), nbytes)

    def finish(self, threads: int) -> list[Pack]:
        """Compute every entry's CRC-32 (on ``threads`` threads: ISA-L and zlib release the GIL
        over large buffers) and return the packs."""
        entries = [e for p in self.packs for e in p.entries]
        run_parallel([lambda g=group: _crc_all(g) for group in _by_bytes(entries, CRC_TASK_BYTES)], threads)
        return self.packs


def nbytes_of(buffer) -> int:
    """Bytes of a buffer: ``bytes``, or anything with ``nbytes`` (numpy arrays, memoryviews)."""
    return len(buffer) if isinstance(buffer, bytes) else memoryview(buffer).nbytes


def crc32_of(buffers: list) -> int:
    """ZIP's CRC-32 of ``buffers`` back to back."""
    crc = 0
    for b in buffers:
        crc = _crc32(b, crc)
    return crc


def _crc_all(entries: list[Entry]) -> None:
    for e in entries:
        e.crc = crc32_of(e.buffers)


def _by_bytes(entries: list[Entry], cap: int) -> list[list[Entry]]:
    """``entries`` cut, in order, into runs of about ``cap`` bytes."""
    groups: list[list[Entry]] = []
    total = cap
    for e in entries:
        if total >= cap:
            groups.append([])
            total = 0
        groups[-1].append(e)
        total += e.nbytes
    return groups
