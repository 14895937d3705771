"""Load from local (``file://``) checkpoints without TensorStore: ``preadv`` straight into the
destination tensor's memory, crc32c verified over the bytes where they landed.

Through TensorStore, loading ``benchmarks/ckpt_bench.py``'s FSDP state from warm page cache took
several times as long as this path, and reshards ran behind PyTorch DCP (benchmarks/README.md,
"Choices in the code"). Local shard files are byte ranges we can address: the
shard's index (``storage/shardfile.py``) gives every inner chunk's offset, so the part of a chunk
that a box needs, when it is one contiguous range both in the chunk and in the destination, is
read by the kernel directly into the destination; only the rest of the chunk (read anyway, for
its checksum) goes to a scratch buffer. Consecutive chunks of one file are read by one
``preadv``. Several reads stay in flight on a small thread pool: ``preadv`` and crc32c (on
buffers >= 32 KiB) release the GIL."""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import crc32c
import numpy as np
import torch

from resilient.dtypes import itemsize, to_numpy, torch_dtype
from resilient.layout import Box
from resilient.manifest import ArrayEntry
from resilient.storage.packread import is_whole_small, whole_shard_tasks
from resilient.storage.parallel import run_parallel
from resilient.storage.shardfile import CRC_BYTES, MISSING, chunk_key, chunks_per_shard, index_nbytes, parse_index
from resilient.storage.shardref import (
    ShardRef,
    chunk_where,
    corrupt,
    damaged,
    gone,
    missing,
    open_shard,
    shard_ref,
    storage_error,
)
from resilient.storage.url import Location

READ_THREADS = 4
"""Reads in flight at once. preadv from the page cache is a kernel memcpy and crc32c runs at
memory speed (benchmarks/README.md, "Choices in the code"), so a few threads keep the memory bus
busy; more only add contention on small hosts."""
TASK_BYTES = 16 << 20
"""Bytes one pool task reads: big enough that the per-task overhead is noise (benchmarks/README.md,
"Choices in the code"), small enough that one big tensor still spreads over every thread."""
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16
"""Buffers one preadv may take (Linux: 1024); a chunk needs up to 3 (scratch, destination, crc)."""
_ITEM_IOVECS = 3


def can_copy_into(dest: torch.Tensor, dtype: str) -> bool:
    """True when the stored bytes of ``dtype`` can be copied into ``dest`` as they are: a CPU tensor
    of that dtype on a little-endian host (strides do not matter to a numpy copy)."""
    return (
        sys.byteorder == "little"
        and dest.device.type == "cpu"
        and dest.dtype == torch_dtype(dtype)
        and not dest.is_conj()
        and not dest.is_neg()
    )


def can_read_locally(location: Location, dest: torch.Tensor, dtype: str) -> bool:
    """True when this path can fill ``dest``: a local file, a dense little-endian CPU tensor of the
    stored dtype (the bytes on disk are then exactly the tensor's bytes). Anything else (S3,
    memory://, CUDA, strided views, a dtype conversion) goes through TensorStore."""
    return (
        location.scheme == "file"
        and sys.byteorder == "little"
        and dest.device.type == "cpu"
        and dest.is_contiguous()
        and dest.dtype == torch_dtype(dtype)
        and not dest.is_conj()
        and not dest.is_neg()
    )


# ---------------------------------------------------------------------------------------------
# what to read


@dataclass(slots=True)
class _ChunkRead:
    """One inner chunk: its bytes ``[a, b)`` land in ``dest`` directly (when the needed part is one
    contiguous range in both), the rest of the chunk and its crc go to scratch. With no direct
    range, the whole chunk goes to scratch and ``copy`` = (destination view, the chunk's part)."""

    grid_index: tuple[int, ...]
    offset: int
    nbytes: int  # data bytes, crc excluded
    span: tuple[int, int] = (0, 0)
    dest: memoryview | None = None
    copy: tuple[np.ndarray, tuple[slice, ...]] | None = None

    @property
    def scratch_bytes(self) -> int:
        return self.nbytes + CRC_BYTES - (self.span[1] - self.span[0])


@dataclass(slots=True)
class _Run:
    """Chunks of one shard that follow each other in the file: one preadv."""

    shard: ShardRef
    chunks: list[_ChunkRead] = field(default_factory=list)
    nbytes: int = 0  # read from the file, crcs included
    scratch_bytes: int = 0

    def add(self, read: _ChunkRead) -> None:
        self.chunks.append(read)
        self.nbytes += read.nbytes + CRC_BYTES
        self.scratch_bytes += read.scratch_bytes


def _contiguous_range(lo: tuple[int, ...], sizes: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, int] | None:
    """Elements ``[start, stop)`` that the box (lo, sizes) occupies in a C-ordered array of shape
    ``full``, or None when they are not one range: leading dims of size 1, one free dim, and
    every dim after it taken whole."""
    k = next((d for d, s in enumerate(sizes) if s != 1), len(sizes))
    if any(s != f for s, f in zip(sizes[k + 1 :], full[k + 1 :], strict=True)):
        return None
    start = 0
    for o, f in zip(lo, full, strict=True):
        start = start * f + o
    return start, start + math.prod(sizes)


def grid_range(box: Box, origin: tuple[int, ...], step: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Indices of the cells of side ``step`` (grid starting at ``origin``) that ``box`` overlaps."""
    ranges = [
        range((o - z) // s, -(-(o + n - z) // s))
        for o, n, z, s in zip(box.offsets, box.sizes, origin, step, strict=True)
    ]
    return itertools.product(*ranges)  # a 0-d array has one cell, the empty index ()


def shards_of(entry: ArrayEntry, box: Box) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], Box]]:
    """(shard grid index, the shard's first element, the part of ``box`` inside the shard)."""
    shape, shard_shape = tuple(entry.shape), tuple(entry.shard_shape)
    for index in grid_range(box, (0,) * len(shape), shard_shape):
        start = tuple(i * s for i, s in zip(index, shard_shape, strict=True))
        region = Box(start, tuple(min(s, n - o) for s, n, o in zip(shard_shape, shape, start, strict=True)))
        part = region.intersect(box)
        if part is not None:
            yield tuple(index), start, part


def _plan_chunks(
    shard: ShardRef,
    index: np.ndarray,
    data_end: int,
    grid: tuple[int, ...],
    origin: tuple[int, ...],
    part: Box,
    box: Box,
    dest: np.ndarray,
) -> list[_ChunkRead]:
    """The reads of every inner chunk of one shard that ``part`` (the box's part in the shard)
    overlaps, sorted by file offset; checks each index entry against the chunk's known size."""
    inner, item = shard.inner_shape, shard.dtype.itemsize
    chunk_bytes = math.prod(inner) * item
    dest_bytes = dest.reshape(-1).view(np.uint8)
    reads = []
    for grid_index in grid_range(part, origin, inner):
        n = int(np.ravel_multi_index(grid_index, grid)) if grid else 0
        offset, nbytes = (int(x) for x in index[n])
        if offset == MISSING or nbytes == MISSING:
            raise missing(shard, chunk_where(shard, grid_index), "is absent from the shard's index")
        if nbytes != chunk_bytes + CRC_BYTES or offset + nbytes > data_end:
            detail = f"has index entry (offset {offset}, {nbytes} bytes) but holds {chunk_bytes + CRC_BYTES} bytes"
            raise damaged(shard, chunk_where(shard, grid_index), f"{detail} within the first {data_end} bytes")
        start = tuple(o + g * i for o, g, i in zip(origin, grid_index, inner, strict=True))
        cell = Box(start, inner).intersect(part)
        in_chunk = tuple(o - s for o, s in zip(cell.offsets, start, strict=True))
        in_dest = tuple(o - b for o, b in zip(cell.offsets, box.offsets, strict=True))
        read = _ChunkRead(tuple(grid_index), shard.base + offset, chunk_bytes)
        source, target = (
            _contiguous_range(in_chunk, cell.sizes, inner),
            _contiguous_range(in_dest, cell.sizes, box.sizes),
        )
        if source is not None and target is not None:
            read.span = (source[0] * item, source[1] * item)
            read.dest = memoryview(dest_bytes[target[0] * item : target[1] * item])
        else:
            dst = dest[tuple(slice(o, o + s) for o, s in zip(in_dest, cell.sizes, strict=True))]
            read.copy = (dst, tuple(slice(o, o + s) for o, s in zip(in_chunk, cell.sizes, strict=True)))
        reads.append(read)
    reads.sort(key=lambda r: r.offset)
    return reads


def _runs(shard: ShardRef, reads: list[_ChunkRead], scratch_cap: int) -> Iterator[_Run]:
    """Group reads that follow each other in the file into preadv-sized runs."""
    run = _Run(shard)
    for read in reads:
        last = run.chunks[-1] if run.chunks else None
        adjacent = last is not None and last.offset + last.nbytes + CRC_BYTES == read.offset
        fits = (
            len(run.chunks) < IOV_MAX // _ITEM_IOVECS
            and run.nbytes + read.nbytes + CRC_BYTES <= TASK_BYTES
            and run.scratch_bytes + read.scratch_bytes <= scratch_cap
        )
        if run.chunks and not (adjacent and fits):
            yield run
            run = _Run(shard)
        run.add(read)
    if run.chunks:
        yield run


class _Tally:
    """Bytes fetched from files by a load's threads (read amplification = fetched / needed)."""

    def __init__(self) -> None:
        self.fetched = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.fetched += nbytes


def _read_index(shard: ShardRef, shard_shape: tuple[int, ...], tally: _Tally) -> tuple[np.ndarray, int]:
    """The shard's index (checksum verified) and where its chunk data ends."""
    tail_bytes = index_nbytes(shard_shape, shard.inner_shape)
    tally.add(tail_bytes)
    fd = open_shard(shard)
    try:
        size = os.fstat(fd).st_size
        end = size if shard.nbytes is None else shard.base + shard.nbytes
        if size < end:
            raise damaged(
                shard, f"shard object {shard.key!r}", f"is cut short: its pack is {size} bytes, the shard ends at {end}"
            )
        if end - shard.base < tail_bytes:
            detail = f"is {end - shard.base} bytes, shorter than its index ({tail_bytes})"
            raise damaged(shard, f"shard object {shard.key!r}", detail)
        tail = os.pread(fd, tail_bytes, end - tail_bytes)
    except OSError as err:
        raise storage_error(shard, err) from err
    finally:
        os.close(fd)
    try:
        return parse_index(tail, shard_shape, shard.inner_shape), end - tail_bytes - shard.base
    except ValueError as err:
        raise corrupt(shard, f"the index of shard object {shard.key!r}") from err


# ---------------------------------------------------------------------------------------------
# reading


class _Scratch(threading.local):
    """One reusable scratch buffer per pool thread: fresh memory would cost a page fault per 4 KiB
    on every read, which is as slow as the read itself."""

    buffer: np.ndarray | None = None

    def get(self, nbytes: int) -> memoryview:
        if self.buffer is None or self.buffer.nbytes < nbytes:
            self.buffer = np.empty(nbytes, dtype=np.uint8)
        return memoryview(self.buffer)[:nbytes]


def _preadv_exact(fd: int, buffers: list[memoryview], offset: int) -> bool:
    """Fill ``buffers`` from ``offset``; False when the file ends first. preadv may stop short of
    the request (signals, > 2 GiB), so it resumes where the kernel stopped."""
    while buffers:
        got = os.preadv(fd, buffers, offset)
        if got == 0:
            return False
        offset += got
        while buffers and got >= len(buffers[0]):
            got -= len(buffers[0])
            buffers = buffers[1:]
        if got:
            buffers = [buffers[0][got:], *buffers[1:]]
    return True


def _scrub(run: _Run) -> None:
    """Zero (the fill value) what this run read straight into the destination: bytes that failed
    or never got their checksum must not be left in the caller's live tensors."""
    for c in run.chunks:
        if c.span[1] > c.span[0]:
            np.frombuffer(c.dest, dtype=np.uint8)[:] = 0


def _read_run(fd: int, run: _Run, scratch: memoryview) -> None:
    """One preadv for the whole run, then each chunk's crc over the bytes where they landed."""
    pieces: list[list[memoryview]] = []
    pos = 0
    for c in run.chunks:
        a, b = c.span
        views = []
        if a > 0:
            views.append(scratch[pos : pos + a])
            pos += a
        if b > a:
            views.append(c.dest)
        rest = c.nbytes - b + CRC_BYTES if b > a else c.nbytes + CRC_BYTES
        views.append(scratch[pos : pos + rest])
        pos += rest
        pieces.append(views)
    if not _preadv_exact(fd, [v for views in pieces for v in views], run.chunks[0].offset):
        _scrub(run)
        where = chunk_where(run.shard, run.chunks[0].grid_index)
        raise damaged(run.shard, where, "is cut short: the file ends inside it")
    for c, views in zip(run.chunks, pieces, strict=True):
        crc = 0
        for v in views[:-1]:
            crc = crc32c.crc32c(v, crc)
        crc = crc32c.crc32c(views[-1][:-CRC_BYTES], crc)
        if crc.to_bytes(CRC_BYTES, "little") != bytes(views[-1][-CRC_BYTES:]):
            _scrub(run)
            raise corrupt(run.shard, chunk_where(run.shard, c.grid_index))
        if c.copy is not None:
            dst, part = c.copy
            chunk = np.frombuffer(views[-1][:-CRC_BYTES], dtype=run.shard.dtype).reshape(run.shard.inner_shape)
            dst[...] = chunk[part]


def _run_task(runs: list[_Run], scratch: _Scratch, tally: _Tally) -> None:
    """Read a task's runs in order, opening each shard file once for its consecutive runs."""
    tally.add(sum(r.nbytes for r in runs))
    buffer = scratch.get(max(r.scratch_bytes for r in runs))
    path, fd = None, -1
    run = runs[0]
    try:
        for run in runs:
            if run.shard.path != path:
                if fd >= 0:
                    os.close(fd)
                    fd = -1
                path = run.shard.path
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError as err:
                    raise missing(run.shard, f"shard object {run.shard.key!r}", gone(run.shard)) from err
            _read_run(fd, run, buffer)
    except OSError as err:
        raise storage_error(run.shard, err) from err
    finally:
        if fd >= 0:
            os.close(fd)


def _target_runs(
    root: str, entry: ArrayEntry, box: Box, dest: torch.Tensor, step: int, scratch_cap: int, held: dict, tally: _Tally
) -> Iterator[_Run]:
    """Every run that fills ``dest`` (the box ``box`` of array ``entry``)."""
    shard_shape, inner = tuple(entry.shard_shape), tuple(entry.inner_shape)
    grid = chunks_per_shard(shard_shape, inner)
    dest_np = to_numpy(dest.detach())
    for shard_index, origin, part in shards_of(entry, box):
        key = chunk_key(shard_index, format_version=entry.format_version)
        shard = shard_ref(root, entry, key, step, dest_np.dtype, held)
        index, data_end = _read_index(shard, shard_shape, tally)
        reads = _plan_chunks(shard, index, data_end, grid, origin, part, box, dest_np)
        yield from _runs(shard, reads, scratch_cap)


@dataclass(frozen=True, slots=True)
class ReadTotals:
    needed: int  # bytes of the boxes filled
    fetched: int  # bytes read from storage to fill them


def read_local(
    location: Location, attempt_key: str, targets: list, *, step: int, budget_bytes: int, threads: int = READ_THREADS
) -> ReadTotals:
    """Fill every target (``reader.ReadTarget``s that ``can_read_locally``); returns the bytes needed
    and the bytes fetched.

    Scratch memory stays within ``budget_bytes``: each thread's scratch holds at most a
    ``budget_bytes / threads`` share (or one inner chunk, when a chunk is bigger than that).
    Raises IntegrityError on a missing, short or corrupted shard, StorageError on other I/O errors;
    no thread writes into a destination after this returns or raises.
    """
    root = "/" + location.join(attempt_key)
    scratch_cap = max(1, budget_bytes // threads)
    scratch, tally = _Scratch(), _Tally()
    live = [t for t in targets if t.box.numel > 0]
    held = held_by_pack(t.entry for t in live)
    # Whole small tensors of packs: neighbours read together (packread); the rest planned per
    # shard, on the threads too, one task ahead of the reads.
    cap = min(TASK_BYTES, scratch_cap)
    small = [t for t in live if is_whole_small(t, cap)]
    rest = [t for t in live if not is_whole_small(t, cap)] if small else live
    small_tasks = whole_shard_tasks(root, small, step, cap, scratch.get, held, tally)
    run_parallel(itertools.chain(small_tasks, _tasks(root, rest, step, scratch_cap, scratch, held, tally)), threads)
    return ReadTotals(sum(t.box.numel * itemsize(t.entry.dtype) for t in live), tally.fetched)


def held_by_pack(entries) -> dict[str, tuple[str, ...]]:
    """Pack -> the tensors (of ``entries``) with a shard in it: what a lost pack takes with it."""
    held: dict[str, set[str]] = {}
    for entry in entries:
        for pack, _offset, _nbytes in entry.shards.values():
            held.setdefault(pack, set()).add(entry.fqn)
    return {pack: tuple(sorted(fqns)) for pack, fqns in held.items()}


def _tasks(
    root: str, targets: list, step: int, scratch_cap: int, scratch: _Scratch, held: dict, tally: _Tally
) -> Iterator[Callable[[], None]]:
    """The load's runs, grouped into tasks of about TASK_BYTES each."""
    task: list[_Run] = []
    task_bytes = 0
    for t in targets:
        for run in _target_runs(root, t.entry, t.box, t.dest, step, scratch_cap, held, tally):
            task.append(run)
            task_bytes += run.nbytes
            if task_bytes >= TASK_BYTES:
                yield functools.partial(_run_task, task, scratch, tally)
                task, task_bytes = [], 0
    if task:
        yield functools.partial(_run_task, task, scratch, tally)
