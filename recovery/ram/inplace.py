"""A snapshot restored straight into the training tensors, checked as it lands.

Fetching a snapshot into fresh memory costs more than the transfer itself on a VM: the kernel
faults in and zeroes every new page, and the bytes are then copied once more into the state
(``ram_bench``'s restore rows; benchmarks/README.md). The training tensors already exist and
are resident, so the restore can put the bytes there at once: a buddy's copy is received into
them (the wire MACs each piece as it lands), an own snapshot is copied into them, and in both
cases each piece's crc32c is taken right after it lands, while it is still in cache, instead of
in a pass of its own (``snapshot_format.CrcAsItLands``).

Only plain dense tensors in host memory can take the bytes; one that cannot (on a GPU, strided,
a tensor subclass) sends the whole restore of that rank the old way.

This is only safe when whatever lands in the tensors is always overwritten if the step is not
restored after all (another rank's fetch failed, so the decision moves on): by an older RAM step,
by the persistent step the policy then loads, which writes every tensor, or, with no persistent
step, by the initial state the caller puts back before its fresh start (``recovery.restore``'s
``reinit``: the trainer rebuilds it from its seed). A caller that can do neither has the restore
decision verify in the snapshot's own memory and copy only once every rank has agreed
(``restore.restore_from_ram``, ``in_place`` off).
"""

from __future__ import annotations

import torch

from resilient.recovery.channel import Scatter
from resilient.recovery.snapshot_format import CrcAsItLands, SnapshotIndex

COPY_PIECE_BYTES = 1 << 20
"""An own snapshot is copied and checksummed in pieces this big: each is still in cache when its
crc32c is taken, cheaper than a pass from memory (benchmarks/README.md, "Choices in the code")."""


def writable_bytes(tensor: torch.Tensor) -> memoryview | None:
    """``tensor``'s bytes as one writable flat view, or None where they cannot be filled in place
    (a tensor subclass, not in host memory, not one dense block, or empty)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):  # subclasses have no .numpy()
        return None
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
        return None
    if tensor.is_conj() or tensor.is_neg() or tensor.numel() == 0:
        return None
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def tensor_targets(index: SnapshotIndex, tensors: dict[str, torch.Tensor]) -> dict[str, memoryview] | None:
    """Each of ``index``'s non-empty tensors as the writable bytes of its training tensor, or None
    when any cannot take them in place (missing, another size, on a GPU, strided, a subclass)."""
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
    """``index``'s payload laid onto ``targets`` (``tensor_targets``) in payload order, the
    alignment gaps into one scratch buffer, with the crc32c of each tensor taken as its pieces land.

    Each view costs at least one receive, MAC update and crc call: nothing for hundreds of tensors,
    noticeable for 10^4 and more. Raises ValueError for tensors that overlap (``CrcAsItLands``)."""

    def __init__(self, index: SnapshotIndex, targets: dict[str, memoryview]) -> None:
        self.index = index
        self.crc = CrcAsItLands(index)
        self.views: list[memoryview] = []
        spans: list[tuple[int, memoryview | None]] = []  # (gap before it, target) in payload order
        position = 0
        for entry in sorted(index.tensors, key=lambda e: (e.offset, e.nbytes)):
            if entry.nbytes:
                spans.append((entry.offset - position, targets[entry.fqn]))
                position = entry.offset + entry.nbytes
        spans.append((index.nbytes - position, None))
        scratch = memoryview(bytearray(max(gap for gap, _ in spans)))  # gaps are never read
        for gap, target in spans:
            if gap:
                self.views.append(scratch[:gap])
            if target is not None:
                self.views.append(target)

    def scatter(self) -> Scatter:
        crc = self.crc
        return Scatter(self.views, lambda _, piece: crc(piece))

    def corruption(self) -> str | None:
        """None if every tensor received matches the snapshot's crc32c; else which does not."""
        return self.crc.corruption()


def copy_verified(index: SnapshotIndex, data: torch.Tensor, targets: dict[str, memoryview]) -> str | None:
    """Copy the snapshot in ``data`` (its slot's bytes) into ``targets`` piece by piece, each piece
    checksummed right after it lands; None if every tensor matches its crc32c, else which does not
    (the targets then hold garbage: see the module docstring)."""
    if data.numel() < index.nbytes:
        return f"snapshot data is {data.numel()} bytes, the index says {index.nbytes}"
    landing = TensorLanding(index, targets)
    source = memoryview(data.numpy())
    position = 0
    for view in landing.views:
        for start in range(0, view.nbytes, COPY_PIECE_BYTES):
            piece = view[start : start + COPY_PIECE_BYTES]
            piece[:] = source[position : position + piece.nbytes]
            landing.crc(piece)
            position += piece.nbytes
    return landing.corruption()
