"""Rank functions for the DCP conversion tests (module-level so spawned ranks can import them).

They reuse the small FSDP2 model of tests/storage/reshard_workers.py and its reference files (the
full tensors as an .npz written by the saving world, no pickle).
"""

from __future__ import annotations

from tests.storage.reshard_workers import build, compare_to_reference, state_of, train_one_step, write_reference


def dcp_save_world(rank: int, world: int, dcp_dir: str, ref_path: str) -> int:
    """FSDP2 over ``world`` ranks, one AdamW step, saved with torch.distributed.checkpoint.save."""
    import torch.distributed.checkpoint as dcp

    model, opt = build("fsdp", seed=0)
    train_one_step(model, opt)
    state = state_of(model, opt)
    write_reference(state, f"{ref_path}.rank{rank}")  # every rank: full_tensor() is collective
    dcp.save(state, checkpoint_id=dcp_dir)
    return rank


def dcp_load_world(rank: int, world: int, dcp_dir: str, ref_path: str) -> dict:
    """A fresh FSDP2 model on ``world`` ranks loads the DCP checkpoint with dcp.load; checked bit for bit."""
    import torch.distributed.checkpoint as dcp

    model, opt = build("fsdp", seed=99)  # different init: everything must come from the checkpoint
    state = state_of(model, opt)
    state["extra"] = {"epoch": 0, "tag": ""}
    dcp.load(state, checkpoint_id=dcp_dir)
    return {
        "checked": compare_to_reference(state, ref_path),
        "extra": state["extra"],
        "lr": state["optim"]["param_groups"][0]["lr"],
    }
