"""A snapshot restored straight into the training tensors, checked as it lands.

Fetching a 256 MiB snapshot into fresh memory costs more than the transfer itself on a VM: the
kernel faults in and zeroes every new page (81 ms here, against 65 ms for the receive), and the
bytes are then copied once more into the state (30 ms). The training tensors already exist and
are resident, so the restore can put the bytes there at once: a buddy's copy is received into
them (the wire MACs each piece as it lands), an own snapshot is copied into them, and in both
cases each piece's crc32c is taken right after it lands, while it is still in cache, instead of
in a pass of its own.

This is only safe when whatever lands in the tensors is always overwritten if the step is not
restored after all (another rank's fetch failed, so the decision moves on): by an older RAM step,
or by the persistent step the policy then loads, which writes every tensor. With no persistent
step the fallback is a fresh start that keeps the initial state, so the restore decision
verifies in the snapshot's own memory and copies only once every rank has agreed
(``restore.restore_from_ram``).
"""

from __future__ import annotations

import crc32c
import numpy as np
import torch

from resilient.recovery.ram.store import CrcAsItLands, SnapshotIndex
from resilient.recovery.ram.wire import Scatter

COPY_PIECE_BYTES = 1 << 20
"""An own snapshot is copied and checksummed in pieces this big: each is still in cache when its
crc32c is taken (1 MiB pieces: 10 ms per 256 MiB here, against 16 ms for a pass from memory)."""


def writable_bytes(tensor: torch.Tensor) -> memoryview | None:
    """``tensor``'s bytes as one writable flat view, or None where they cannot be filled in place
    (not in host memory, not one dense block, or empty)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
        return None
    if tensor.is_conj() or tensor.is_neg() or tensor.numel() == 0:
        return None
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def tensor_targets(index: SnapshotIndex, tensors: dict[str, torch.Tensor]) -> dict[str, memoryview] | None:
    """Each of ``index``'s non-empty tensors as the writable bytes of its training tensor, or None
    when any cannot take them in place (missing, another size, on a GPU, strided)."""
    targets = {}
    for entry in index.tensors:
        tensor = tensors.get(entry.fqn)
        if tensor is None or tensor.numel() * tensor.element_size() != entry.nbytes:
            return None
        if entry.nbytes:
            view = writable_bytes(tensor)
            if view is None:
                return None
            targets[entry.fqn] = view
    return targets


class TensorLanding:
    """A buddy's copy of ``index`` received into ``targets`` (``tensor_targets``): the wire's
    ``Scatter``, the alignment gaps into scratch memory, and the crc32c of each tensor taken as its
    pieces land (``store.CrcAsItLands``: the views are filled in payload order)."""

    def __init__(self, index: SnapshotIndex, targets: dict[str, memoryview]) -> None:
        self.index = index
        self._crc = CrcAsItLands(index)
        self._views: list[memoryview] = []
        position = 0
        for entry in sorted(index.tensors, key=lambda e: e.offset):
            if entry.offset < position:
                raise ValueError(f"tensor {entry.fqn!r} overlaps the one before it in the snapshot")
            self._add(memoryview(bytearray(entry.offset - position)))
            if entry.nbytes:
                self._add(targets[entry.fqn])
            position = entry.offset + entry.nbytes
        if position > index.nbytes:
            raise ValueError(f"the snapshot's tensors end at byte {position}, past its {index.nbytes} bytes")
        self._add(memoryview(bytearray(index.nbytes - position)))

    def _add(self, view: memoryview) -> None:
        if view.nbytes:
            self._views.append(view)

    def scatter(self) -> Scatter:
        crc = self._crc
        return Scatter(self._views, lambda _, piece: crc(piece))

    def corruption(self) -> str | None:
        """None if every tensor received matches the snapshot's crc32c; else which does not."""
        return self._crc.corruption()


def copy_verified(index: SnapshotIndex, data: torch.Tensor, targets: dict[str, memoryview]) -> str | None:
    """Copy the snapshot in ``data`` (its slot's bytes) into ``targets`` piece by piece, each piece
    checksummed right after it lands; None if every tensor matches its crc32c, else which does not
    (the targets then hold garbage: see the module docstring)."""
    if data.numel() < index.nbytes:
        return f"snapshot data is {data.numel()} bytes, the index says {index.nbytes}"
    source = data.numpy()
    for entry in index.tensors:
        src = source[entry.offset : entry.offset + entry.nbytes]
        dst = np.frombuffer(targets[entry.fqn], dtype=np.uint8) if entry.nbytes else src
        crc = 0
        for start in range(0, entry.nbytes, COPY_PIECE_BYTES):
            piece = dst[start : start + COPY_PIECE_BYTES]
            np.copyto(piece, src[start : start + COPY_PIECE_BYTES])
            crc = crc32c.crc32c(piece, crc)
        if crc != entry.crc32c:
            return f"crc32c mismatch in tensor {entry.fqn!r}"
    return None
