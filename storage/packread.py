"""Local loads of whole small tensors out of packs (format version 3): neighbouring shards of one
pack read with one ``pread``, each verified in memory and copied into its tensor.

A small tensor is one shard that is one inner chunk (norms, biases: a model holds thousands). The
general path (``localread``) plans and reads each shard on its own: an open, a read of its index,
a ``preadv`` and a Python plan per tensor, which for 16 KiB tensors cost more than the bytes. Here
the shards a load wants from one pack, sorted by offset, are cut into runs of up to a task's bytes
(the ZIP local headers between them read along: ``GAP_BYTES`` at most), and each run is read
once into the thread's scratch buffer. Every shard's index crc32c and its chunk's crc32c are
checked there, before a byte reaches the destination, so a damaged shard leaves its tensor as it
was; the errors are the general path's (``shardref``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import crc32c
import numpy as np

from resilient.dtypes import to_numpy
from resilient.storage.shardfile import CRC_BYTES, MISSING, chunk_key, index_nbytes, parse_index
from resilient.storage.shardref import (
    ShardRef,
    chunk_where,
    corrupt,
    damaged,
    missing,
    open_shard,
    shard_ref,
    storage_error,
)

GAP_BYTES = 4096
"""Shards of one pack at most this far apart are read in one run, the bytes between included."""


@dataclass(slots=True)
class WholeShard:
    """A tensor that is one shard of one inner chunk, and where its bytes go."""

    ref: ShardRef
    dest: memoryview  # the destination tensor's bytes, all of them
    chunk_bytes: int


def is_whole_small(target, cap: int) -> bool:
    """Whether this path reads ``target`` (a ``reader.ReadTarget`` that ``can_read_locally``): a
    version 3 array that is one shard of one inner chunk (no padding), wanted whole, whose shard
    fits a run of ``cap`` bytes."""
    entry, box = target.entry, target.box
    shape = tuple(entry.shape)
    if entry.format_version < 3 or not shape == tuple(entry.shard_shape) == tuple(entry.inner_shape):
        return False
    ref = entry.shards.get(chunk_key((0,) * len(shape), format_version=entry.format_version))
    return box.sizes == shape and not any(box.offsets) and ref is not None and ref[2] <= cap


def whole_shard_tasks(
    root: str, targets: list, step: int, cap: int, scratch: Callable[[int], memoryview], held: dict, tally
) -> list[Callable[[], None]]:
    """One task per run of neighbouring shards (``cap`` bytes at most) of ``targets``, all of which
    ``is_whole_small``; ``scratch(n)`` gives the running thread's buffer of ``n`` bytes."""
    by_pack: dict[str, list[WholeShard]] = {}
    for t in targets:
        dest = to_numpy(t.dest.detach())
        key = chunk_key((0,) * dest.ndim, format_version=t.entry.format_version)
        ref = shard_ref(root, t.entry, key, step, dest.dtype, held)
        whole = WholeShard(ref, memoryview(dest.reshape(-1).view(np.uint8)), dest.nbytes)
        by_pack.setdefault(ref.path, []).append(whole)
    tasks = []
    for shards in by_pack.values():
        shards.sort(key=lambda s: s.ref.base)
        run: list[WholeShard] = []
        for s in shards:
            if run and (s.ref.base - _end(run[-1]) > GAP_BYTES or _end(s) - run[0].ref.base > cap):
                tasks.append(functools.partial(_read_run, run, scratch, tally))
                run = []
            run.append(s)
        if run:
            tasks.append(functools.partial(_read_run, run, scratch, tally))
    return tasks


def _end(s: WholeShard) -> int:
    return s.ref.base + s.ref.nbytes


def _read_run(run: list[WholeShard], scratch: Callable[[int], memoryview], tally) -> None:
    """Read the run's bytes once, then check and place each shard."""
    first = run[0].ref
    start = first.base
    buffer = scratch(_end(run[-1]) - start)
    tally.add(buffer.nbytes)
    fd = open_shard(first)
    try:
        size = os.fstat(fd).st_size
        got = 0
        while got < buffer.nbytes:  # pread may stop short (signals); the file may end early
            n = os.preadv(fd, [buffer[got:]], start + got)
            if n == 0:
                break
            got += n
    except OSError as err:
        raise storage_error(first, err) from err
    finally:
        os.close(fd)
    for s in run:
        _place(s, buffer[s.ref.base - start : _end(s) - start], size)


def _place(s: WholeShard, shard: memoryview, size: int) -> None:
    """Check the shard's index and chunk (in scratch), then copy the chunk into the tensor."""
    ref = s.ref
    where, tail = f"shard object {ref.key!r}", index_nbytes(ref.inner_shape, ref.inner_shape)
    if size < _end(s):
        raise damaged(ref, where, f"is cut short: its pack is {size} bytes, the shard ends at {_end(s)}")
    if ref.nbytes < tail:
        raise damaged(ref, where, f"is {ref.nbytes} bytes, shorter than its index ({tail})")
    try:
        index = parse_index(shard[-tail:], ref.inner_shape, ref.inner_shape)
    except ValueError as err:
        raise corrupt(ref, f"the index of shard object {ref.key!r}") from err
    offset, nbytes = (int(x) for x in index[0])
    chunk = chunk_where(ref, (0,) * len(ref.inner_shape))
    if offset == MISSING or nbytes == MISSING:
        raise missing(ref, chunk, "is absent from the shard's index")
    data_end = ref.nbytes - tail
    if nbytes != s.chunk_bytes + CRC_BYTES or offset + nbytes > data_end:
        detail = f"has index entry (offset {offset}, {nbytes} bytes) but holds {s.chunk_bytes + CRC_BYTES} bytes"
        raise damaged(ref, chunk, f"{detail} within the first {data_end} bytes")
    data = shard[offset : offset + s.chunk_bytes]
    stored = bytes(shard[offset + s.chunk_bytes : offset + nbytes])
    if crc32c.crc32c(data).to_bytes(CRC_BYTES, "little") != stored:
        raise corrupt(ref, chunk)
    s.dest[:] = data
