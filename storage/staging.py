"""Host staging buffers for snapshots: allocated once, reused for every later save.

A snapshot copies this rank's regions into one flat byte buffer; training is blocked only for
that copy. Copying into freshly allocated memory ran ~5x slower here than into reused memory
(page faults on first touch), so buffers are kept and handed out again. Under CUDA the buffers
are pinned, so device->host copies run asynchronously on a side stream.

The pool's counters (``allocations``, ``bytes_allocated``, ``reuses``) let tests assert that a
second save allocates nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from resilient.errors import ConfigError, QuorumTimeout

_ALIGN = 64  # each region starts on a cache line


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(slots=True)
class StagingBuffer:
    data: torch.Tensor  # flat uint8, pinned under CUDA, shared-memory for a writer process
    in_use: bool = False

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.data[offset : offset + nbytes].view(dtype).view(shape)


@dataclass(slots=True)
class StagingPool:
    """Reusable staging buffers within a byte budget (``budget_bytes``)."""

    budget_bytes: int
    pin_memory: bool = False
    shared_memory: bool = False
    allocations: int = 0
    bytes_allocated: int = 0
    reuses: int = 0
    _buffers: list[StagingBuffer] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def bytes_held(self) -> int:
        return sum(b.capacity for b in self._buffers)

    def acquire(self, nbytes: int, *, timeout_s: float) -> StagingBuffer:
        """A free buffer of at least ``nbytes``; allocates only if none fits and the budget allows,
        else waits (up to ``timeout_s``) for a persist in flight to hand one back."""
        if nbytes > self.budget_bytes:
            raise ConfigError(
                f"a snapshot needs {nbytes / 2**20:.1f} MiB of staging memory but "
                f"staging_bytes is {self.budget_bytes / 2**20:.1f} MiB; raise staging_bytes"
            )
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (buf := self._try_take(nbytes)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QuorumTimeout(
                        f"no staging buffer of {nbytes / 2**20:.1f} MiB became free within {timeout_s:.0f} s "
                        "(every buffer is held by a persist in flight)"
                    )
                self._cond.wait(remaining)
            return buf

    def _try_take(self, nbytes: int) -> StagingBuffer | None:
        free = [b for b in self._buffers if not b.in_use and b.capacity >= nbytes]
        if free:
            buf = min(free, key=lambda b: b.capacity)
            self.reuses += 1
        else:
            spare = [b for b in self._buffers if not b.in_use]
            # Grow by replacing a too-small free buffer rather than keeping both.
            if spare and self.bytes_held - spare[0].capacity + nbytes <= self.budget_bytes:
                self._buffers.remove(spare[0])
            elif self.bytes_held + nbytes > self.budget_bytes:
                return None
            buf = self._allocate(nbytes)
        buf.in_use = True
        return buf

    def _allocate(self, nbytes: int) -> StagingBuffer:
        data = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin_memory)
        if self.shared_memory:
            data.share_memory_()
        buf = StagingBuffer(data)
        self._buffers.append(buf)
        self.allocations += 1
        self.bytes_allocated += data.numel()
        return buf

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            buf.in_use = False
            self._cond.notify_all()
