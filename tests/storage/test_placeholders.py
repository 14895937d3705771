"""Pipeline placeholders in ``Checkpointer.save``/``load`` (``resilient.state.placeholder``): every
rank names every tensor, each writes only its own stage's, and the step reads back on any world.

Two gloo ranks, as two pipeline stages: rank 0 holds "a" (a plain tensor) and "c" (a DTensor on its
1-rank "tp" submesh), rank 1 holds "b" and "d"; each passes placeholders for the other's."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.dist import outcome, run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(60)]

SHAPES = {"a": (6, 4), "b": (5,), "c": (4, 3), "d": (8,)}
DTYPES = {"a": torch.float32, "b": torch.bfloat16, "c": torch.float32, "d": torch.int64}
OWNER = {"a": 0, "b": 1, "c": 0, "d": 1}
DTENSORS = ("c", "d")


def _value(fqn: str) -> torch.Tensor:
    """The saved value of ``fqn``: distinct per tensor, so a value read into the wrong key shows."""
    base = {"a": 10, "b": 20, "c": 30, "d": 40}[fqn]
    n = int(np.prod(SHAPES[fqn]))
    return (torch.arange(n) + base).reshape(SHAPES[fqn]).to(DTYPES[fqn])


def _stage_state(rank: int, mesh, fill=_value) -> dict:
    """Rank ``rank``'s state: its own tensors real (``fill(fqn)``), the others' placeholders."""
    from torch.distributed.tensor import DTensor, Shard

    from resilient.state import placeholder

    model: dict = {}
    for fqn in SHAPES:
        if OWNER[fqn] != rank:
            model[fqn] = placeholder(SHAPES[fqn], DTYPES[fqn])
        elif fqn in DTENSORS:
            model[fqn] = DTensor.from_local(fill(fqn), mesh, [Shard(0)], run_check=False)
        else:
            model[fqn] = fill(fqn)
    return {"model": model, "step": 7}


def _local(value) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _stages(rank: int, world: int, root: str) -> dict:
    """Save the split state, load it back into the split, then the two refused saves."""
    from torch.distributed.device_mesh import init_device_mesh

    from resilient import Checkpointer
    from resilient.state import held_elsewhere

    # ("pp", "tp") = (2, 1): each rank's "tp" submesh is itself alone, as a stage's TP mesh.
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "tp"))["tp"]
    result: dict = {}

    ckpt = Checkpointer(os.path.join(root, "split"))
    ckpt.save(1, _stage_state(rank, mesh)).wait(timeout=30)
    target = _stage_state(rank, mesh, fill=lambda fqn: torch.zeros(SHAPES[fqn], dtype=DTYPES[fqn]))
    target["step"] = -1
    result["load_step"] = ckpt.load(target)
    result["loaded"] = {
        fqn: ("meta" if held_elsewhere(v) else _local(v).tolist(), str(v.dtype), list(v.shape))
        for fqn, v in target["model"].items()
    }
    result["json_step"] = target["step"]
    ckpt.close()

    # (d) no rank holds "b": rank 1 names it as a placeholder too.
    orphan = Checkpointer(os.path.join(root, "orphan"))
    state = _stage_state(rank, mesh)
    if rank == 1:
        from resilient.state import placeholder

        state["model"]["b"] = placeholder(SHAPES["b"], DTYPES["b"])
    result["orphan"] = outcome(lambda: orphan.save(1, state).wait(timeout=30))
    result["orphan_next"] = outcome(lambda: orphan.save(2, _stage_state(rank, mesh)).wait(timeout=30))
    result["orphan_steps"] = orphan.steps()
    orphan.close()

    # (e) rank 1's placeholder for "a" has another shape than rank 0's real "a".
    wrong = Checkpointer(os.path.join(root, "wrong"))
    state = _stage_state(rank, mesh)
    if rank == 1:
        from resilient.state import placeholder

        state["model"]["a"] = placeholder((6, 5), DTYPES["a"])
    result["wrong_shape"] = outcome(lambda: wrong.save(1, state).wait(timeout=30))
    result["wrong_steps"] = wrong.steps()
    wrong.close()
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("placeholders"))
    return root, run_world(_stages, 2, root, timeout_s=50)


def _manifest(root: str, step: int = 1) -> dict:
    with open(os.path.join(root, "split", f"step-{step:09d}", "manifest.json")) as f:
        return json.load(f)


def test_each_stage_writes_its_own_and_the_manifest_keeps_the_holders_layout(saved):
    from torch.distributed.tensor import Shard

    root, _ = saved
    manifest = _manifest(root)
    assert sorted(manifest["arrays"]) == sorted(f"model.{k}" for k in SHAPES)
    for fqn in SHAPES:
        entry = manifest["arrays"][f"model.{fqn}"]
        assert entry["shape"] == list(SHAPES[fqn]), fqn
        assert [r["writer"] for r in entry["regions"]] == [OWNER[fqn]], fqn
        # The placements come from the holder, never from the other rank's placeholder.
        if fqn in DTENSORS:
            assert entry["placements"] == [str(Shard(0))] and entry["mesh_shape"] == [1], fqn
            assert entry["mesh_dim_names"] == ["tp"], fqn
        else:
            assert entry["placements"] == [] and entry["mesh_shape"] == [], fqn


def test_one_process_loads_every_tensor_of_a_split_save(saved):
    from resilient import Checkpointer

    root, _ = saved
    target = {"model": {fqn: torch.zeros(SHAPES[fqn], dtype=DTYPES[fqn]) for fqn in SHAPES}, "step": -1}
    assert Checkpointer(os.path.join(root, "split")).load(target) == 1  # no process group: world 1
    assert target["step"] == 7
    for fqn in SHAPES:
        got = target["model"][fqn]
        assert got.dtype == DTYPES[fqn] and torch.equal(got, _value(fqn)), fqn


def test_each_stage_loads_its_own_and_its_placeholders_stay_meta(saved):
    _, results = saved
    for rank, result in enumerate(results):
        assert result["load_step"] == 1 and result["json_step"] == 7
        for fqn in SHAPES:
            values, dtype, shape = result["loaded"][fqn]
            assert dtype == str(DTYPES[fqn]) and shape == list(SHAPES[fqn]), (rank, fqn)
            if OWNER[fqn] == rank:
                assert values == _value(fqn).tolist(), (rank, fqn)
            else:
                assert values == "meta", (rank, fqn)


def test_zarr_python_reads_every_array_of_a_split_save(saved):
    import zarr

    import resilient.zarr_bfloat16  # noqa: F401  (teaches zarr-python bfloat16)
    from resilient.dtypes import to_numpy

    root, _ = saved
    manifest = _manifest(root)
    attempt = os.path.join(root, "split", "step-000000001", manifest["attempt"])
    for fqn in SHAPES:
        # each array is written whole by its stage's rank: that rank's pack opens it alone
        (pack,) = {ref[0] for ref in manifest["arrays"][f"model.{fqn}"]["shards"].values()}
        store = zarr.storage.ZipStore(os.path.join(attempt, pack), mode="r")
        got = zarr.open_array(store, path=f"model/{fqn}", mode="r")[...]
        want = to_numpy(_value(fqn))
        assert got.dtype == want.dtype and got.shape == SHAPES[fqn], fqn
        np.testing.assert_array_equal(got, want, err_msg=fqn)


def test_a_tensor_no_rank_holds_is_refused_on_every_rank_naming_it(saved):
    _, results = saved
    first, second = (r["orphan"] for r in results)
    assert first == second, "every rank must raise the same error at the same call"
    assert first.startswith("StateError: ") and "'model.b'" in first
    assert "do not tile it exactly" in first
    # Refused before anything was written; the next save of a whole state commits.
    assert [r["orphan_next"] for r in results] == ["ok", "ok"]
    assert [r["orphan_steps"] for r in results] == [[2], [2]]


def test_a_placeholder_of_another_shape_is_refused_on_every_rank_naming_it(saved):
    _, results = saved
    first, second = (r["wrong_shape"] for r in results)
    assert first == second, "every rank must raise the same error at the same call"
    assert first.startswith("StateError: ") and "'model.a'" in first
    assert "[6, 4]" in first and "[6, 5]" in first
    assert [r["wrong_steps"] for r in results] == [[], []]
