"""The FSDP2 + AdamW state of ``ckpt_bench.py``'s save/load worlds, and how a load is checked.

A stack of square ``Linear`` layers built on meta, sharded with ``fully_shard`` on a 1-D mesh of the
whole world, one AdamW step taken so the moments exist. ``fingerprint`` summarizes every tensor by
global row position, so a resharding load that skipped or misplaced rows fails the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def build_state(cfg: Any, seed: int) -> tuple[Any, Any, dict]:
    """FSDP2 model on a 1-D mesh of the whole world, one AdamW step taken; returns its state.
    ``cfg`` is ckpt_bench's BenchConfig (``width``, ``layers``)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Built on meta and materialized after sharding (torchtitan's recipe): no rank ever holds
    # the whole model, and no time goes into initializing weights that are then thrown away.
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(cfg.width, cfg.width) for _ in range(cfg.layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, cfg.width**-0.5, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, cfg.width, generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, fresh_state(model, opt)


def fresh_state(model: Any, opt: Any) -> dict:
    """A new state dict over the same storage. Each load gets its own, because a load may replace
    non-tensor values (param_groups) with its own representation of them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def iter_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from iter_tensors(tree[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_tensors(v, f"{prefix}.{i}")


def local_part(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(state: dict) -> tuple[int, int]:
    """(bytes of the global state, bytes this rank holds). Plain tensors (the optimizer's
    ``step``) are replicated: counted once globally, but every rank holds a copy."""
    total = local = 0
    for _, t in iter_tensors(state):
        local += local_part(t).numel() * t.element_size()
        total += t.numel() * t.element_size()  # a DTensor's numel is its global numel
    return total, local


def fingerprint(state: dict) -> list[list[float]]:
    """Per tensor, [sum over rows of (row sum x global row index), the same over |x|]: catches rows
    that were not loaded or landed at the wrong offset after resharding. The second value scales
    the tolerance, since only the float64 summation order depends on the world size. Collective."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sharded, replicated = [], []
    for _, t in iter_tensors(state):
        data = local_part(t).detach()
        if data.dim() == 0:
            value = float(data.double())
            replicated.append([value, abs(value)])
            continue
        offset = 0
        if isinstance(t, DTensor):
            offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1][0]
        rows = data.reshape(data.shape[0], -1)
        weights = torch.arange(offset + 1, offset + 1 + rows.shape[0], dtype=torch.float64)
        sharded.append(
            [
                float(rows.sum(dim=1, dtype=torch.float64) @ weights),
                float(rows.abs().sum(dim=1, dtype=torch.float64) @ weights),
            ]
        )
    summed = torch.tensor(sharded, dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(summed)  # every tensor with rows here is a DTensor: the pieces add up
    return summed.tolist() + replicated


def check_fingerprint(got: list[list[float]], want: list[list[float]], what: str) -> None:
    bad = [
        i
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if abs(g[0] - w[0]) > 1e-11 * w[1] or abs(g[1] - w[1]) > 1e-11 * w[1]
    ]
    if len(got) != len(want) or bad:
        raise AssertionError(f"{what}: loaded state differs from the saved one (tensors #{bad[:5]})")


def zero_state(state: dict) -> None:
    """Wipe the destination so a load that silently skipped a tensor fails the fingerprint."""
    import torch

    with torch.no_grad():
        for _, t in iter_tensors(state):
            local_part(t).zero_()
