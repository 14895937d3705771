"""Thin helpers over torch.distributed that also work with no process group (one process)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def is_distributed(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order. Callers send plain JSON-able data (str, dict, list)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``src`` is a rank of ``group``)."""
    if not is_distributed():
        return obj
    box = [obj]
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(box, src=global_src, group=group)
    return box[0]


def barrier(group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group=group)
