"""Streaming in bounded memory: C-order blocks of a box, and a byte-bounded read -> write pipeline.

The offline tools (verify, diff, convert, reshard) never hold a whole tensor: they walk it in
blocks of at most a few MiB to a few hundred MiB and keep a bounded number of bytes in flight, so
a 100 GiB checkpoint converts on a machine with 8 GiB of RAM. Blocks are *C-order* pieces: their
bytes, concatenated in order, are the box's bytes in C order, which is what lets a crc32c or a
safetensors file be written block by block.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from resilient.layout import Box

_ML_DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a zarr v3 data type name (bfloat16/float8 through ml_dtypes)."""
    return np.dtype(_ML_DTYPES.get(name, name))


def c_order_blocks(box: Box, itemsize: int, max_bytes: int, row_align: int = 1) -> Iterator[Box]:
    """Split ``box`` into pieces of at most ``max_bytes`` whose concatenation is the box in C order.

    Whole rows (dim 0) when a row fits, in multiples of ``row_align`` rows when possible (so a
    block covers whole inner chunks and no chunk is decoded twice); a row that does not fit is
    split the same way along the next dim.
    """
    if box.numel == 0:
        return
    if not box.sizes:
        yield box
        return
    row_bytes = math.prod(box.sizes[1:]) * itemsize
    first, rest_off, rest_size = box.offsets[0], box.offsets[1:], box.sizes[1:]
    if row_bytes <= max_bytes:
        rows = max(1, max_bytes // max(row_bytes, 1))
        if rows >= row_align > 1:
            rows -= rows % row_align
        for start in range(0, box.sizes[0], rows):
            yield Box((first + start, *rest_off), (min(rows, box.sizes[0] - start), *rest_size))
        return
    for i in range(box.sizes[0]):
        for sub in c_order_blocks(Box(rest_off, rest_size), itemsize, max_bytes):
            yield Box((first + i, *sub.offsets), (1, *sub.sizes))


def linear_offset(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """Index of the element at ``offsets`` in the C-order flattening of ``shape``."""
    index = 0
    for n, o in zip(shape, offsets, strict=True):
        index = index * n + o
    return index


def grid_boxes(shape: tuple[int, ...], chunk: tuple[int, ...]) -> list[Box]:
    """Every cell of the regular grid ``chunk`` over ``shape``, clipped at the edges, in C order."""
    if math.prod(shape) == 0:
        return []
    counts = [math.ceil(n / c) for n, c in zip(shape, chunk, strict=True)]
    boxes = []
    for index in np.ndindex(*counts):
        lo = tuple(i * c for i, c in zip(index, chunk, strict=True))
        boxes.append(Box(lo, tuple(min(c, n - o) for c, n, o in zip(chunk, shape, lo, strict=True))))
    return boxes


class Pending(Protocol):
    def result(self) -> Any: ...


class Done:
    """An already-computed result, for sources that read synchronously."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self) -> Any:
        return self._value


class Both:
    """Two pending reads as one (diff reads the same block of two checkpoints)."""

    def __init__(self, a: Pending, b: Pending) -> None:
        self._a, self._b = a, b

    def result(self) -> tuple[Any, Any]:
        return self._a.result(), self._b.result()


class Pipeline:
    """Reads issued ahead, each handed in order to its ``then`` (which may start a write); the
    bytes of reads and writes in flight stay under ``budget_bytes`` (one item may exceed it alone).

    Items are processed strictly in submission order, so a ``then`` that folds a running checksum
    over a region's blocks sees them in C order.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._reads: deque = deque()
        self._writes: deque = deque()
        self._bytes = 0

    def add(
        self,
        nbytes: int,
        issue: Callable[[], Pending],
        then: Callable[[Any], Any],
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """Start ``issue()`` once there is room; ``then(value)`` may return a pending write (kept
        alive with its data until done). ``on_error`` receives a failed read instead of raising."""
        while (self._reads or self._writes) and self._bytes + nbytes > self.budget_bytes:
            self._step()
        self._reads.append((nbytes, issue(), then, on_error))
        self._bytes += nbytes

    def drain(self) -> None:
        while self._reads or self._writes:
            self._step()

    def _step(self) -> None:
        if self._writes and (not self._reads or len(self._writes) > 1):
            nbytes, pending = self._writes.popleft()
            pending.result()
            self._bytes -= nbytes
            return
        nbytes, pending, then, on_error = self._reads.popleft()
        try:
            write = then(pending.result())
        except Exception as e:
            if on_error is None:
                self._bytes -= nbytes
                raise
            on_error(e)
            write = None
        if write is None:
            self._bytes -= nbytes
        else:
            self._writes.append((nbytes, write))
