"""storage/describe.py: a tensor is described once and reused while its layout cannot have changed;
its data is always the tensor's current storage."""

from __future__ import annotations

import pytest
import torch

from resilient.layout import Box, describe_json, describe_local
from resilient.storage.describe import LayoutCache
from tests.dist import run_world

pytestmark = pytest.mark.timeout(120)


def test_plain_tensors_are_described_once_and_their_data_is_current() -> None:
    w, b = torch.randn(4, 3, requires_grad=True), torch.arange(5)
    cache = LayoutCache()
    first, info = cache.describe({"w": w, "b": b})
    assert (cache.hits, cache.misses) == (0, 2)
    assert info == [describe_json(describe_local("w", w.detach())), describe_json(describe_local("b", b))]
    assert first["w"].box == Box((0, 0), (4, 3)) and first["b"].box == Box((0,), (5,))

    again, info_again = cache.describe({"w": w, "b": b})
    assert (cache.hits, cache.misses) == (2, 2)
    assert info_again == info and all(x is y for x, y in zip(info_again, info, strict=True))
    assert again["w"].box == first["w"].box and again["w"].dtype == "float32"

    # Storage swapped in place with the same shape: still the same layout, but the new bytes.
    w.data = torch.ones(4, 3)
    swapped, _ = cache.describe({"w": w, "b": b})
    assert (cache.hits, cache.misses) == (4, 2)
    assert swapped["w"].data.data_ptr() == w.data_ptr() and torch.equal(swapped["w"].data, torch.ones(4, 3))

    # A new shape, or a new object under the same name, is described anew.
    b.data = torch.arange(7)
    other_w = torch.zeros(4, 3)
    changed, info_changed = cache.describe({"w": other_w, "b": b})
    assert (cache.hits, cache.misses) == (4, 4)
    assert changed["b"].box == Box((0,), (7,)) and info_changed[1]["shape"] == [7]
    assert changed["w"].data.data_ptr() == other_w.data_ptr()

    # Names no longer in the state are forgotten; an empty tensor holds no box.
    only, info_only = cache.describe({"e": torch.zeros(0, 2)})
    assert list(only) == ["e"] and only["e"].box is None and info_only[0]["box"] is None
    assert list(cache._entries) == ["e"]


def test_a_dropped_tensor_is_not_kept_alive_by_the_cache() -> None:
    import weakref

    cache = LayoutCache()
    t = torch.randn(8)
    cache.describe({"t": t})
    ref = weakref.ref(t)
    del t
    assert ref() is None


def _dtensor_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    cache = LayoutCache()
    out: dict = {"names": [str(Shard(0)), str(Replicate())]}  # "S(0)", "R" in torch 2.13
    first, info = cache.describe({"x": dt})
    out["first"] = (first["x"].box.to_json(), info[0]["placements"], cache.hits, cache.misses)
    again, _ = cache.describe({"x": dt})
    out["again"] = (again["x"].box.to_json(), again["x"].data.tolist(), cache.hits, cache.misses)
    # FSDP2 replaces a sharded parameter's local tensor in place (reset_sharded_param): described anew.
    dt._local_tensor = dt._local_tensor.clone() + 100
    swapped, _ = cache.describe({"x": dt})
    out["swapped"] = (swapped["x"].data.tolist(), cache.hits, cache.misses)
    replicated = dt.redistribute(mesh, [Replicate()])
    moved, info_moved = cache.describe({"x": replicated})
    out["moved"] = (moved["x"].box.to_json(), info_moved[0]["placements"], cache.hits, cache.misses)
    return out


@pytest.mark.dist
def test_dtensor_layout_is_reused_until_its_local_tensor_or_placement_changes() -> None:
    results = run_world(_dtensor_worker, 2, timeout_s=90)
    rows = {0: [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]], 1: [[9.0, 10.0, 11.0], [12.0, 13.0, 14.0]]}
    boxes = {0: {"offsets": [0, 0], "sizes": [3, 3]}, 1: {"offsets": [3, 0], "sizes": [2, 3]}}
    for rank, out in enumerate(results):
        shard, replicate = out["names"]
        assert out["first"] == (boxes[rank], [shard], 0, 1)
        assert out["again"] == (boxes[rank], rows[rank], 1, 1)
        assert out["swapped"] == ([[v + 100 for v in row] for row in rows[rank]], 1, 2)
        assert out["moved"] == ({"offsets": [0, 0], "sizes": [5, 3]}, [replicate], 1, 3)
