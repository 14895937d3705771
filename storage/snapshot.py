"""Snapshot: copy this rank's regions into a reused staging buffer — the only part of a save
that blocks training. Under CUDA the device->host copies go on a side stream into pinned memory
and return at once; the returned event says when the bytes are staged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from resilient.dtypes import torch_dtype
from resilient.layout import ArrayPlan, LocalTensor
from resilient.storage.persist import StagedRegion
from resilient.storage.staging import StagingBuffer, StagingPool, aligned


@dataclass(slots=True)
class Snapshot:
    buffer: StagingBuffer
    regions: list[StagedRegion]
    nbytes: int
    staged: torch.cuda.Event | None  # None: the copy is already complete (CPU)


def _source(local: LocalTensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    rel = tuple(slice(o - lo, o - lo + s) for o, lo, s in zip(offsets, local.box.offsets, sizes, strict=True))
    return local.data[rel] if rel else local.data


def take_snapshot(
    plans: dict[str, ArrayPlan], locals_: dict[str, LocalTensor], rank: int, pool: StagingPool,
    *, timeout_s: float, stream: torch.cuda.Stream | None = None,
) -> Snapshot:
    mine = [(plan, region) for plan in plans.values() for region in plan.regions if region.writer == rank]
    regions, offset = [], 0
    for plan, region in mine:
        nbytes = region.box.numel * locals_[plan.fqn].data.element_size()
        regions.append(StagedRegion(plan.fqn, region.box, offset, nbytes))
        offset += aligned(nbytes)
    buffer = pool.acquire(offset, timeout_s=timeout_s)
    event = None
    if stream is not None:
        # The side stream must see the parameters as of now, not a later optimizer step.
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else _nullcontext():
        for (plan, region), staged in zip(mine, regions, strict=True):
            src = _source(locals_[plan.fqn], region.box.offsets, region.box.sizes)
            dst = buffer.view(staged.offset, staged.nbytes, torch_dtype(plan.dtype), region.box.sizes)
            dst.copy_(src, non_blocking=stream is not None)
            if stream is not None and src.is_cuda:
                src.record_stream(stream)  # keep the source alive until the copy has run
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
    return Snapshot(buffer, regions, offset, event)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
