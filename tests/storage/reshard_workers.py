"""Rank functions for the resharding round trips (module-level so spawned ranks can import them).

A small model with fp32 and bf16 parameters, trained one AdamW step, parallelized as FSDP2 + TP on
a (dp, tp) mesh; saved from one layout, loaded onto others, compared bit for bit with a reference
of the full tensors that the saving world writes as an .npz (no pickle).
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn as nn

IN, HIDDEN = 24, 40  # 40 rows over 3 ranks: 14, 14, 12 (uneven shards)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN, bias=False).to(torch.bfloat16)
        self.norm = nn.LayerNorm(IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x)).to(torch.bfloat16)
        return self.norm(self.down(h).float())


def build(layout: str, seed: int):
    """layout: "none" (one process), "fsdp" (1-D dp mesh), "tp_a"/"tp_b" (2x2, TP on other dims)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Net()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        fully_shard(model.down, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout in ("tp_a", "tp_b"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        if layout == "tp_a":  # up: rows split by TP (Shard(0)), down: columns (Shard(1))
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        else:  # the other dims: up: Shard(1), down: Shard(0)
            plan = {"up": RowwiseParallel(), "down": ColwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model.down, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_one_step(model, opt) -> None:
    torch.manual_seed(123)
    x = torch.randn(8, IN)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"epoch": 3, "tag": "reshard-test"}}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def write_reference(state: dict, path: str) -> None:
    from resilient.dtypes import to_numpy
    from resilient.state import flatten_state

    arrays, dtypes = {}, {}
    for fqn, leaf in flatten_state(state).items():
        if leaf.is_tensor:
            full = _full(leaf.value).detach().cpu()
            dtypes[fqn] = str(full.dtype)
            arrays[fqn] = to_numpy(full.reshape(-1)).view(np.uint8)
            arrays[fqn + ".shape"] = np.array(full.shape, dtype=np.int64)
    np.savez(path, **{k.replace("/", "|"): v for k, v in arrays.items()})
    with open(path + ".json", "w") as f:
        json.dump(dtypes, f)


def compare_to_reference(state: dict, path: str) -> int:
    """Check every local piece against the reference; returns how many tensors were compared."""
    from resilient.layout import describe_local
    from resilient.state import flatten_state

    ref = np.load(path if path.endswith(".npz") else path + ".npz", allow_pickle=False)
    with open(path + ".json") as f:
        dtypes = json.load(f)
    checked = 0
    for fqn, leaf in flatten_state(state).items():
        if not leaf.is_tensor:
            continue
        dtype = getattr(torch, dtypes[fqn].removeprefix("torch."))
        shape = tuple(ref[fqn + ".shape"].tolist())
        full = torch.from_numpy(ref[fqn].copy()).view(dtype).reshape(shape)
        local = describe_local(fqn, leaf.value)
        if local.box is None:
            continue
        expected = full[local.box.slices()] if shape else full
        got = local.data.detach().cpu()
        assert got.dtype == expected.dtype, (fqn, got.dtype, expected.dtype)
        assert torch.equal(
            got.view(torch.uint8) if got.dim() else got.reshape(1).view(torch.uint8),
            expected.contiguous().view(torch.uint8) if expected.dim() else expected.reshape(1).view(torch.uint8),
        ), f"{fqn} differs at box {local.box}"
        checked += 1
    return checked


def save_world(rank: int, world: int, url: str, ref_path: str, layout: str) -> dict:
    from resilient import Checkpointer

    model, opt = build(layout, seed=0)
    train_one_step(model, opt)
    state = state_of(model, opt)
    write_reference(state, f"{ref_path}.rank{rank}")  # every rank: full_tensor() is collective
    ckpt = Checkpointer(url)
    ckpt.save(7, state).wait()
    return {"steps": ckpt.steps()}


def load_world(rank: int, world: int, url: str, ref_path: str, layout: str) -> dict:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from resilient import Checkpointer

    model, opt = build(layout, seed=99)  # different init: everything must come from the checkpoint
    state = state_of(model, opt)
    state["extra"] = {"epoch": 0, "tag": ""}
    step = Checkpointer(url).load(state)
    checked = compare_to_reference(state, ref_path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after = compare_to_reference(state_of(model, opt), ref_path)
    return {"step": step, "checked": checked, "after_set": after, "extra": state["extra"]}
