"""Load: read each target box straight from the zarr arrays into the destination tensors.

Local checkpoints read into dense CPU tensors take the direct path of ``localread`` (preadv into
the destination's memory; the parts of a chunk a box does not need land in scratch, read only for
their checksum); format version 3 on object storage into CPU tensors of the stored dtype takes
``rangeread`` (ranged reads into the packs); everything else (versions 1 and 2 on S3 or
memory://, CUDA destinations, a dtype conversion) goes through TensorStore.

TensorStore fetches only the inner chunks that overlap a box and verifies their crc32c, then
decodes straight into the destination's memory when it can (dense CPU tensors), so a load makes
no second copy. Reads are kept in flight up to a byte budget: memory stays bounded while I/O
stays parallel.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from resilient.dtypes import from_numpy, itemsize, to_numpy, torch_dtype
from resilient.layout import Box
from resilient.manifest import ArrayEntry
from resilient.storage.arrays import open_entry, read_error
from resilient.storage.localread import ReadTotals, can_copy_into, can_read_locally, read_local
from resilient.storage.rangeread import read_ranged
from resilient.storage.url import Location


@dataclass(slots=True)
class ReadTarget:
    entry: ArrayEntry
    box: Box
    dest: torch.Tensor  # the local tensor to fill, shape == box.sizes


def _direct_view(dest: torch.Tensor):
    """A TensorStore view of ``dest``'s own memory, when TensorStore can write there (CPU, dense)."""
    import tensorstore as ts

    if dest.device.type != "cpu" or not dest.is_contiguous():
        return None
    return ts.array(to_numpy(dest), copy=False, write=True)


def read_into(
    location: Location, attempt_key: str, targets: list[ReadTarget], context, *, step: int, budget_bytes: int
) -> ReadTotals:
    """Fill every target; returns the bytes needed and fetched (TensorStore's reads count as
    needed: it does not say what it fetched). Raises IntegrityError on a bad/missing chunk."""
    local = [t for t in targets if can_read_locally(location, t.dest, t.entry.dtype)]
    rest = [t for t in targets if not can_read_locally(location, t.dest, t.entry.dtype)]
    ranged = [t for t in rest if t.entry.format_version >= 3 and can_copy_into(t.dest, t.entry.dtype)]
    others = [t for t in rest if not (t.entry.format_version >= 3 and can_copy_into(t.dest, t.entry.dtype))]
    needed = fetched = 0
    for got in (
        read_local(location, attempt_key, local, step=step, budget_bytes=budget_bytes) if local else None,
        read_ranged(location, attempt_key, ranged, context, step=step, budget_bytes=budget_bytes) if ranged else None,
    ):
        if got is not None:
            needed, fetched = needed + got.needed, fetched + got.fetched
    if others:
        nbytes = read_tensorstore(location, attempt_key, others, context, step=step, budget_bytes=budget_bytes)
        needed, fetched = needed + nbytes, fetched + nbytes
    return ReadTotals(needed, fetched)


def read_tensorstore(
    location: Location, attempt_key: str, targets: list[ReadTarget], context, *, step: int, budget_bytes: int
) -> int:
    """Fill every target through TensorStore (any location, any destination)."""
    opened = {}
    for t in targets:
        e = t.entry
        if e.fqn not in opened:
            opened[e.fqn] = open_entry(location, attempt_key, e, context)
    inflight: deque = deque()
    inflight_bytes = 0
    total = 0
    url = f"{location.url}/{attempt_key}"

    def fail(target: ReadTarget, err: Exception) -> Exception:
        return read_error(err, fqn=target.entry.fqn, step=step, url=f"{url}/{target.entry.path}")

    def drain_one() -> None:
        nonlocal inflight_bytes, total
        target, future, nbytes, direct = inflight.popleft()
        try:
            result = future.result()
        except Exception as err:
            raise fail(target, err) from err
        if not direct:
            target.dest.copy_(from_numpy(result, torch_dtype(target.entry.dtype)).reshape(target.dest.shape))
        inflight_bytes -= nbytes
        total += nbytes

    for t in targets:
        nbytes = t.box.numel * itemsize(t.entry.dtype)
        while inflight and inflight_bytes + nbytes > budget_bytes:
            drain_one()
        try:
            store = opened[t.entry.fqn].result()
        except Exception as err:
            raise fail(t, err) from err
        source = store[t.box.slices()].translate_to[0] if t.box.sizes else store
        direct = _direct_view(t.dest)
        if direct is not None:
            inflight.append((t, direct.write(source), nbytes, True))
        else:
            inflight.append((t, source.read(), nbytes, False))
        inflight_bytes += nbytes
    while inflight:
        drain_one()
    return total
