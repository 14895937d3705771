"""Load format version 3 from object storage (S3, memory://) with ranged reads into the packs.

The manifest says where each shard lies in its pack, so nothing is listed and no ZIP directory is
read. A shard of at most ``WHOLE_SHARD_BYTES``, or one the load needs at least half of, is fetched
whole (its index and chunks in one request), and whole-shard ranges of one pack that lie close
together are merged into one request of up to ``RANGE_CAP_BYTES`` (``MERGE_GAP_BYTES`` of ZIP
headers between them is cheaper to fetch than another round trip: 2,000 small tensors of one rank
come back in a few requests, not 2,000). Any other shard is read in two rounds: its index (the
shard's last bytes), then only the inner chunks a box overlaps, neighbours joined. Every chunk's
crc32c and every index's are verified before a byte lands in a destination. Requests go out
through TensorStore's kvstore (its S3 client: credentials, endpoint, retries), all in flight at
once up to the load's byte budget.

TensorStore's own zarr3-over-``zip`` path (the spec a plain reader uses) opens the pack's ZIP
directory for every array: 2,000 small tensors took ~100 s to load from the loopback endpoint
against ~2 s for DCP (benchmarks/README.md, "packed layout"); this path takes them in one pass.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import crc32c
import numpy as np

from resilient.dtypes import itemsize, to_numpy
from resilient.errors import IntegrityError, StorageError
from resilient.layout import Box
from resilient.manifest import ArrayEntry
from resilient.storage.arrays import kvstore_spec
from resilient.storage.localread import ReadTotals, grid_range, held_by_pack, shards_of
from resilient.storage.shardfile import CRC_BYTES, MISSING, chunk_key, chunks_per_shard, index_nbytes, parse_index
from resilient.storage.url import Location

WHOLE_SHARD_BYTES = 4 << 20
"""Shards up to this size are fetched whole: one request instead of two, and little to waste."""
MERGE_GAP_BYTES = 256 << 10
"""Whole-shard ranges of one pack closer than this are fetched by one request."""
RANGE_CAP_BYTES = 64 << 20
"""The most one merged request fetches."""


@dataclass(slots=True)
class _Part:
    """One shard's part that one target needs: ``part`` (global box) of shard ``key``."""

    target: object  # reader.ReadTarget
    key: str
    origin: tuple[int, ...]
    part: Box


@dataclass(slots=True)
class _Shard:
    entry: ArrayEntry
    key: str
    pack: str
    base: int
    nbytes: int
    parts: list[_Part] = field(default_factory=list)


@dataclass(slots=True)
class _Range:
    """One request: ``[start, stop)`` of ``pack``, and what to do with its bytes."""

    pack: str
    start: int
    stop: int
    shards: list[_Shard] = field(default_factory=list)  # whole shards inside the range
    chunks: list[tuple[_Shard, int, list]] = field(default_factory=list)  # (shard, first chunk offset, reads)


class _Reads:
    """Ranged reads in flight, at most ``budget`` bytes, results handled in order."""

    def __init__(self, location: Location, attempt_key: str, context, budget: int, step: int, held: dict) -> None:
        import tensorstore as ts

        self.kv = ts.KvStore.open(kvstore_spec(location, attempt_key), context=context).result()
        self.url, self.budget, self.step, self.held = f"{location.url}/{attempt_key}", budget, step, held
        self.inflight: deque = deque()
        self.inflight_bytes = 0
        self.fetched = 0

    def add(self, r: _Range, then) -> None:
        size = r.stop - r.start
        while self.inflight and self.inflight_bytes + size > self.budget:
            self._one()
        future = self.kv.read(r.pack, byte_range=slice(r.start, r.stop))
        self.inflight.append((r, future, then))
        self.inflight_bytes += size

    def drain(self) -> None:
        while self.inflight:
            self._one()

    def _one(self) -> None:
        r, future, then = self.inflight.popleft()
        size = r.stop - r.start
        self.inflight_bytes -= size
        fqns = self.held.get(r.pack, ())
        where = f"pack {r.pack!r} ({self.url}/{r.pack}, bytes {r.start}-{r.stop})"
        try:
            got = future.result()
        except Exception as err:
            if "OUT_OF_RANGE" in str(err):
                raise _lost(self.step, fqns, f"{where} is cut short") from err
            raise StorageError(f"reading {where} at step {self.step} failed: {err}") from err
        if got.state == "missing":
            raise _lost(self.step, fqns, f"{where} does not exist", missing=True)
        data = memoryview(got.value)
        if data.nbytes != size:
            raise _lost(self.step, fqns, f"{where} is cut short ({data.nbytes} of {size} bytes)")
        self.fetched += size
        then(r, data)


def _lost(step: int, fqns: tuple[str, ...], what: str, *, missing: bool = False) -> IntegrityError:
    shown = ", ".join(repr(f) for f in fqns[:8]) + (f" and {len(fqns) - 8} more" if len(fqns) > 8 else "")
    state = "is missing data" if missing else "is damaged"
    return IntegrityError(
        f"step {step} {state}: {what}; it holds tensors {shown}. Load another step (load(state, step=...))."
    )


def read_ranged(
    location: Location, attempt_key: str, targets: list, context, *, step: int, budget_bytes: int
) -> ReadTotals:
    """Fill every target (``reader.ReadTarget`` of a version 3 array, any CPU destination) from the
    packs; returns the bytes needed and fetched. Raises IntegrityError on damage."""
    live = [t for t in targets if t.box.numel > 0]
    held = held_by_pack(t.entry for t in live)
    reads = _Reads(location, attempt_key, context, max(budget_bytes, 1), step, held)
    small, big = _shards(live, step)
    for r in _merged(small):
        reads.add(r, lambda r, data: [_fill_shard(s, data[s.base - r.start :][: s.nbytes], step) for s in r.shards])
    indexes: dict[int, np.ndarray] = {}
    for shard in big:  # round 1: each big shard's index
        tail = index_nbytes(tuple(shard.entry.shard_shape), tuple(shard.entry.inner_shape))
        r = _Range(shard.pack, shard.base + shard.nbytes - tail, shard.base + shard.nbytes, [shard])
        reads.add(r, lambda r, data: indexes.__setitem__(id(r.shards[0]), _index(r.shards[0], data, step)))
    reads.drain()
    ranges = [r for shard in big for r in _chunk_ranges(shard, indexes[id(shard)], step)]
    for r in _joined(ranges):  # round 2: the chunks the boxes overlap
        reads.add(r, lambda r, data: _fill_chunks(r, data, step))
    reads.drain()
    needed = sum(t.box.numel * itemsize(t.entry.dtype) for t in live)
    return ReadTotals(needed, reads.fetched)


def _shards(targets: list, step: int) -> tuple[list[_Shard], list[_Shard]]:
    """Every shard the targets overlap, once, with the parts each target needs: (small, big)."""
    shards: dict[tuple[str, str], _Shard] = {}
    for t in targets:
        for index, origin, part in shards_of(t.entry, t.box):
            key = chunk_key(index, format_version=t.entry.format_version)
            ref = t.entry.shards.get(key)
            if ref is None:
                raise IntegrityError(
                    f"tensor {t.entry.fqn!r} at step {step} is missing data: the manifest names no pack for "
                    f"shard {key!r}. The checkpoint is damaged; load another step."
                )
            shard = shards.setdefault((t.entry.fqn, key), _Shard(t.entry, key, *ref))
            shard.parts.append(_Part(t, key, origin, part))
    whole = [s for s in shards.values() if s.nbytes <= WHOLE_SHARD_BYTES or _mostly_needed(s)]
    parts = [s for s in shards.values() if not (s.nbytes <= WHOLE_SHARD_BYTES or _mostly_needed(s))]
    return whole, parts


def _mostly_needed(shard: _Shard) -> bool:
    """Whether the targets need at least half of the shard: then one request for all of it (no
    index round first) wastes less than it saves."""
    shape, grid = shard.entry.shape, shard.entry.shard_shape
    start = shard.parts[0].origin
    in_bounds = math.prod(min(g, n - o) for g, n, o in zip(grid, shape, start, strict=True))
    return 2 * sum(p.part.numel for p in shard.parts) >= in_bounds


def _merged(shards: list[_Shard]) -> list[_Range]:
    """Whole-shard ranges, merged per pack where they lie within ``MERGE_GAP_BYTES``."""
    out: list[_Range] = []
    for s in sorted(shards, key=lambda s: (s.pack, s.base)):
        last = out[-1] if out else None
        if (
            last is not None
            and last.pack == s.pack
            and s.base - last.stop <= MERGE_GAP_BYTES
            and s.base + s.nbytes - last.start <= RANGE_CAP_BYTES
        ):
            last.stop = max(last.stop, s.base + s.nbytes)
            last.shards.append(s)
        else:
            out.append(_Range(s.pack, s.base, s.base + s.nbytes, [s]))
    return out


def _where(shard: _Shard, what: str, step: int) -> str:
    return f"tensor {shard.entry.fqn!r} at step {step}, {what} of shard object {shard.key!r} in pack {shard.pack!r}"


def _index(shard: _Shard, tail: memoryview, step: int) -> np.ndarray:
    try:
        return parse_index(tail, tuple(shard.entry.shard_shape), tuple(shard.entry.inner_shape))
    except ValueError as err:
        raise IntegrityError(
            f"checksum mismatch in {_where(shard, 'the index', step)}: the stored bytes are corrupted. "
            "Load another step (load(state, step=...)) or restore from a replica."
        ) from err


def _chunk_bytes(shard: _Shard) -> int:
    return math.prod(shard.entry.inner_shape) * itemsize(shard.entry.dtype)


def _entry_of(shard: _Shard, index: np.ndarray, grid_index: tuple[int, ...], step: int) -> int:
    """The chunk's offset in the shard, its index entry checked against its known size."""
    grid = chunks_per_shard(tuple(shard.entry.shard_shape), tuple(shard.entry.inner_shape))
    n = int(np.ravel_multi_index(grid_index, grid)) if grid else 0
    offset, nbytes = (int(x) for x in index[n])
    where = _where(shard, f"inner chunk {{{', '.join(map(str, grid_index))}}}", step)
    if offset == MISSING or nbytes == MISSING:
        raise IntegrityError(f"{where} is absent from the shard's index: the checkpoint is damaged; load another step.")
    if nbytes != _chunk_bytes(shard) + CRC_BYTES or offset + nbytes > shard.nbytes:
        raise IntegrityError(f"{where} has a wrong index entry ({offset}, {nbytes}): the checkpoint is damaged.")
    return offset


def _copy_chunk(shard: _Shard, part: _Part, grid_index: tuple[int, ...], raw: memoryview, step: int) -> None:
    """Check one chunk's crc32c, then copy what ``part``'s target needs of it into the target."""
    data, stored = raw[:-CRC_BYTES], bytes(raw[-CRC_BYTES:])
    if crc32c.crc32c(data).to_bytes(CRC_BYTES, "little") != stored:
        where = _where(shard, f"inner chunk {{{', '.join(map(str, grid_index))}}}", step)
        raise IntegrityError(
            f"checksum mismatch in {where}: the stored bytes are corrupted. Load another step "
            "(load(state, step=...)) or restore from a replica."
        )
    inner = tuple(shard.entry.inner_shape)
    dest = to_numpy(part.target.dest.detach())
    chunk = np.frombuffer(data, dtype=dest.dtype).reshape(inner)
    start = tuple(o + g * i for o, g, i in zip(part.origin, grid_index, inner, strict=True))
    cell = Box(start, inner).intersect(part.part)
    src = tuple(slice(o - s, o - s + n) for o, s, n in zip(cell.offsets, start, cell.sizes, strict=True))
    box = part.target.box
    dst = tuple(slice(o - b, o - b + n) for o, b, n in zip(cell.offsets, box.offsets, cell.sizes, strict=True))
    dest[dst] = chunk[src]


def _fill_shard(shard: _Shard, data: memoryview, step: int) -> None:
    """A whole shard in memory: its index, then every chunk its parts need."""
    tail = index_nbytes(tuple(shard.entry.shard_shape), tuple(shard.entry.inner_shape))
    index = _index(shard, data[shard.nbytes - tail :], step)
    size = _chunk_bytes(shard) + CRC_BYTES
    for part in shard.parts:
        for grid_index in grid_range(part.part, part.origin, tuple(shard.entry.inner_shape)):
            offset = _entry_of(shard, index, tuple(grid_index), step)
            _copy_chunk(shard, part, tuple(grid_index), data[offset : offset + size], step)


def _chunk_ranges(shard: _Shard, index: np.ndarray, step: int) -> list[_Range]:
    """Requests for the chunks of a big shard its parts overlap, consecutive chunks merged."""
    size = _chunk_bytes(shard) + CRC_BYTES
    wanted: dict[int, list] = {}  # offset in shard -> [(part, grid index)]
    for part in shard.parts:
        for grid_index in grid_range(part.part, part.origin, tuple(shard.entry.inner_shape)):
            offset = _entry_of(shard, index, tuple(grid_index), step)
            wanted.setdefault(offset, []).append((part, tuple(grid_index)))
    out: list[_Range] = []
    for offset in sorted(wanted):
        start = shard.base + offset
        last = out[-1] if out else None
        if last is not None and last.stop == start and last.stop - last.start + size <= RANGE_CAP_BYTES:
            last.stop += size
        else:
            last = _Range(shard.pack, start, start + size)
            out.append(last)
        last.chunks.append((shard, offset, wanted[offset]))
    return out


def _joined(ranges: list[_Range]) -> list[_Range]:
    """Chunk ranges of one pack that lie within ``MERGE_GAP_BYTES`` of each other, joined up to
    ``RANGE_CAP_BYTES`` (neighbouring shards' chunks included)."""
    out: list[_Range] = []
    for r in sorted(ranges, key=lambda r: (r.pack, r.start)):
        last = out[-1] if out else None
        if (
            last is not None
            and last.pack == r.pack
            and 0 <= r.start - last.stop <= MERGE_GAP_BYTES
            and r.stop - last.start <= RANGE_CAP_BYTES
        ):
            last.stop = r.stop
            last.chunks += r.chunks
        else:
            out.append(r)
    return out


def _fill_chunks(r: _Range, data: memoryview, step: int) -> None:
    for shard, offset, uses in r.chunks:
        at = shard.base + offset - r.start
        raw = data[at : at + _chunk_bytes(shard) + CRC_BYTES]
        for part, grid_index in uses:
            _copy_chunk(shard, part, grid_index, raw, step)
