"""storage/snapshot.py and save()'s early copy: the snapshot is taken while the agreement crosses,
by the last plan; it is retaken when a peer's layout changed the plan, discarded (its staging buffer
freed) when any rank failed, and what is committed is always the state as of save()."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _state(rank: int, mesh, value: float) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "w": distribute_tensor(torch.full((6, 4), value), mesh, [Shard(0)]),
        "b": torch.full((3,), value),
        "step": int(value),
    }


def _loaded(ckpt, mesh) -> list[float]:
    target = _state(0, mesh, -1.0)
    ckpt.load(target)
    return [target["w"].full_tensor().unique().tolist(), target["b"].unique().tolist(), target["step"]]


def _save_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import resilient.storage.checkpointer as module
    from resilient import Checkpointer, StateError

    copies = []
    real = module.take_snapshot
    module.take_snapshot = lambda *a, **k: copies.append(1) or real(*a, **k)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ckpt = Checkpointer(root)
    state = _state(rank, mesh, 1.0)
    out: dict = {}

    def save(step: int, **kwargs) -> int:
        copies.clear()
        ckpt.save(step, state, **kwargs).wait(timeout=60)
        return len(copies)

    out["first"] = save(1)  # no plan yet: copied after the agreement
    state["w"].to_local().fill_(2.0)
    state["b"].fill_(2.0)
    state["step"] = 2
    out["unchanged"] = [save(2), _loaded(ckpt, mesh)]
    state["b"] = torch.full((3,), 3.0)  # a new object, the same layout: the plan still holds
    state["step"] = 3
    out["new_object"] = [save(3), _loaded(ckpt, mesh)]
    if rank == 1:
        ckpt._planner.sent_tensors = None  # rank 1 resends its layout: every rank replans
    state["step"] = 4
    out["peer_resent"] = [save(4), _loaded(ckpt, mesh)]
    try:  # a failure on rank 1 only: rank 0 copied early and must let its buffer go
        save(5, metadata={"bad": {1, 2}} if rank == 1 else None)
    except StateError as e:
        out["failed"] = [str(e), len(copies), [b.in_use for b in ckpt._pool._buffers]]
    state["step"] = 5  # every rank resends its layout after a failed agreement: no early copy
    out["after_failure"] = [save(5), _loaded(ckpt, mesh)]
    good_b = state["b"]
    state["b"] = torch.zeros(5) if rank == 1 else good_b  # ranks disagree on the shape: no plan
    try:
        save(6)
    except StateError as e:
        out["no_plan"] = [str(e), len(copies), [b.in_use for b in ckpt._pool._buffers]]
    state["b"], state["step"] = good_b, 7
    out["recovered"] = [save(7), _loaded(ckpt, mesh), ckpt.steps(), ckpt._pool.allocations]
    ckpt.close()
    return out


def test_early_snapshot_is_used_retaken_or_discarded_and_commits_the_state_of_save(tmp_path):
    results = run_world(_save_worker, 2, str(tmp_path), timeout_s=150)
    for rank, out in enumerate(results):
        assert out["first"] == 1
        assert out["unchanged"] == [1, [[2.0], [2.0], 2]]
        assert out["new_object"] == [1, [[2.0], [3.0], 3]]
        # Rank 0 copied by the old plan, then again by the new one; rank 1 knew its layout was sent.
        assert out["peer_resent"] == [2 if rank == 0 else 1, [[2.0], [3.0], 4]]
        message, copies, in_use = out["failed"]
        assert message.startswith("[rank 1] metadata is not JSON-able")
        assert (copies, in_use) == (1 if rank == 0 else 0, [False])
        message, copies, in_use = out["no_plan"]
        assert "tensor 'b' has global shape" in message
        assert (copies, in_use) == (1 if rank == 0 else 0, [False])
        assert out["after_failure"] == [1, [[2.0], [3.0], 5]]
        assert out["recovered"] == [1, [[2.0], [3.0], 7], [1, 2, 3, 4, 5, 7], 1]
