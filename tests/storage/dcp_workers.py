"""Rank functions for the resilient.dcp multi-process tests (module-level so spawned ranks import them).

The model, its FSDP2 layout, one AdamW step and the reference of full tensors are the resharding
tests' (``reshard_workers``): saved on one world size through plain DCP calls, loaded on another.
"""

from __future__ import annotations

import os

import torch

from tests.storage.reshard_workers import build, compare_to_reference, state_of, train_one_step, write_reference

BLANK_EXTRA = {"epoch": 0, "tag": ""}


def save_four_ways(rank: int, world: int, url: str, ref_path: str) -> list[int]:
    """Steps 1-4 of the same state: dcp.save with our planners, with DCP's defaults, dcp.async_save
    (thread) with our planners, and our Checkpointer."""
    import torch.distributed.checkpoint as dcp

    from resilient import Checkpointer
    from resilient.dcp import SavePlanner, StorageWriter

    model, opt = build("fsdp", seed=0)
    train_one_step(model, opt)
    state = state_of(model, opt)
    write_reference(state, f"{ref_path}.rank{rank}")
    dcp.save(state, storage_writer=StorageWriter(url, step=1), planner=SavePlanner())
    dcp.save(state, storage_writer=StorageWriter(url, step=2))
    dcp.async_save(state, storage_writer=StorageWriter(url, step=3), planner=SavePlanner()).result(timeout=120)
    Checkpointer(url).save(4, state).wait()
    return Checkpointer(url).steps()


def load_every_way(rank: int, world: int, url: str, ref_path: str) -> dict:
    """Each step through dcp.load (our planner; DCP's default planner with trust_pickle for step 2),
    and step 1 through our Checkpointer: every local piece equals the saving world's tensors."""
    import torch.distributed.checkpoint as dcp

    from resilient import Checkpointer
    from resilient.dcp import LoadPlanner, StorageReader

    out: dict = {}
    for step in (1, 2, 3, 4):
        model, opt = build("fsdp", seed=99)
        state = state_of(model, opt)
        state["extra"] = dict(BLANK_EXTRA)
        if step == 2:
            dcp.load(state, storage_reader=StorageReader(url, step=2, trust_pickle=True))
        else:
            dcp.load(state, storage_reader=StorageReader(url, step=step), planner=LoadPlanner())
        out[f"dcp{step}"] = [compare_to_reference(state, ref_path), state["extra"]]
    model, opt = build("fsdp", seed=99)
    state = state_of(model, opt)
    state["extra"] = dict(BLANK_EXTRA)
    Checkpointer(url).load(state, step=1)
    out["checkpointer1"] = [compare_to_reference(state, ref_path), state["extra"]]
    return out


def process_async_save(rank: int, world: int, url: str, ref_path: str) -> int:
    """dcp.async_save in DCP's checkpoint process: the writer is pickled and sent there."""
    import multiprocessing

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from resilient.dcp import SavePlanner, StorageWriter

    # tests/dist.py starts ranks as daemons (none outlives a test); DCP's checkpoint process is a
    # child of the rank, which a daemon may not have. It is a daemon itself: it ends with the rank.
    multiprocessing.current_process()._config["daemon"] = False
    model, opt = build("fsdp", seed=0)
    train_one_step(model, opt)
    state = state_of(model, opt)
    write_reference(state, f"{ref_path}.rank{rank}")
    future = dcp.async_save(
        state,
        storage_writer=StorageWriter(url, step=6),
        planner=SavePlanner(),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    future.result(timeout=240)
    return rank


def save_then_async_save(rank: int, world: int, url: str, fault: str) -> None:
    """Step 1 committed, then an async_save of step 2 that rank 1 pauses in (and is killed in).
    Each rank holds its own tensor, so each writes one (DCP writes a replicated one once)."""
    import torch.distributed.checkpoint as dcp

    from resilient.dcp import SavePlanner, StorageWriter

    state = {f"w{rank}": torch.full((1024, 256), 1.0), "meta": {"step": 1}}
    dcp.save(state, storage_writer=StorageWriter(url, step=1), planner=SavePlanner())
    os.environ["RESILIENT_FAULTS"] = fault
    state = {f"w{rank}": torch.full((1024, 256), 2.0), "meta": {"step": 2}}
    dcp.async_save(state, storage_writer=StorageWriter(url, step=2), planner=SavePlanner()).result(timeout=600)


def load_step_in_one_process(rank: int, world: int, url: str, ref_path: str, step: int) -> int:
    """dcp.load of ``step`` into an unsharded model in one process (no group)."""
    import torch.distributed.checkpoint as dcp

    from resilient.dcp import LoadPlanner, StorageReader

    model, opt = build("none", seed=99)
    state = state_of(model, opt)
    dcp.load(state, storage_reader=StorageReader(url, step=step), planner=LoadPlanner())
    return compare_to_reference(state, ref_path)
