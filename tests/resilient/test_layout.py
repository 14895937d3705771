"""The save plan: shard grids that never straddle boxes, replicas written once and spread."""

from __future__ import annotations

import math

import pytest

from resilient.errors import StateError
from resilient.layout import Box, choose_inner_shape, plan_arrays

pytestmark = pytest.mark.timeout(30)


def _info(fqn, shape, box, dtype="float32"):
    return {
        "fqn": fqn,
        "shape": list(shape),
        "dtype": dtype,
        "box": box.to_json() if box else None,
        "placements": [],
        "mesh_shape": [],
        "mesh_dim_names": [],
    }


def _covered_once(plan):
    cells = {}
    for region in plan.regions:
        for idx in _cells(region.box):
            cells[idx] = cells.get(idx, 0) + 1
    return len(cells) == math.prod(plan.shape) and set(cells.values()) == {1}


def _cells(box):
    import itertools

    return itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True)))


def test_uneven_shards_get_a_grid_aligned_to_every_box():
    # 10 rows on 3 ranks, torch.chunk style: 4, 4, 2
    boxes = [Box((0, 0), (4, 3)), Box((4, 0), (4, 3)), Box((8, 0), (2, 3))]
    plans = plan_arrays([[_info("w", (10, 3), b)] for b in boxes])
    plan = plans["w"]
    assert plan.shard_shape == (4, 3)
    assert [(r.box, r.writer) for r in plan.regions] == list(zip(boxes, [0, 1, 2], strict=True))
    assert _covered_once(plan)


def test_strided_boxes_that_do_not_form_a_regular_grid_still_align():
    # TP 2 then FSDP 2 on the same 10 rows: 3,2 | 3,2 -> edges 3,5,8 -> gcd 1
    boxes = [Box((0,), (3,)), Box((3,), (2,)), Box((5,), (3,)), Box((8,), (2,))]
    plan = plan_arrays([[_info("w", (10,), b)] for b in boxes])["w"]
    assert plan.shard_shape == (1,)
    assert sorted(r.writer for r in plan.regions) == [0, 1, 2, 3]
    assert _covered_once(plan)


def test_replicated_tensor_is_written_once_and_split_across_replicas():
    full = Box((0, 0), (4096, 1024))  # 16 MiB fp32, replicated on 4 ranks
    plan = plan_arrays([[_info("emb", (4096, 1024), full)] for _ in range(4)])["emb"]
    assert sum(r.box.numel for r in plan.regions) == full.numel  # written once: no overlap, no gap
    assert all(a.box.intersect(b.box) is None for a in plan.regions for b in plan.regions if a is not b)
    assert sorted(r.writer for r in plan.regions) == [0, 1, 2, 3]
    assert {r.box.sizes[0] for r in plan.regions} == {1024}


def test_small_replicated_tensors_are_balanced_over_ranks():
    infos = [[_info(f"t{i}", (8,), Box((0,), (8,))) for i in range(8)] for _ in range(4)]
    plans = plan_arrays(infos)
    writers = [p.regions[0].writer for p in plans.values()]
    assert all(len(p.regions) == 1 for p in plans.values())
    assert sorted(writers) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_dp_replicated_tp_sharded_boxes_are_written_once():
    # mesh (dp=2, tp=2), placements (Replicate, Shard(0)): ranks 0,2 hold rows 0:4; ranks 1,3 rows 4:8
    per_rank = [[_info("w", (8, 2), Box((0 if r % 2 == 0 else 4, 0), (4, 2)))] for r in range(4)]
    plan = plan_arrays(per_rank)["w"]
    assert len(plan.regions) == 2 and _covered_once(plan)
    assert {plan.regions[0].writer, plan.regions[1].writer} == {0, 1}


def test_zero_dim_and_empty_boxes():
    per_rank = [
        [_info("step", (), Box((), ())), _info("w", (2, 3), Box((0, 0), (2, 3)) if r == 0 else None)] for r in range(3)
    ]
    plans = plan_arrays(per_rank)
    assert plans["step"].shard_shape == () and len(plans["step"].regions) == 1
    assert [r.writer for r in plans["w"].regions] == [0]


def test_inconsistent_ranks_are_rejected_with_the_tensor_named():
    with pytest.raises(StateError, match=r"'w'.*ranks \[0\] but not of ranks \[1\]"):
        plan_arrays([[_info("w", (4,), Box((0,), (4,)))], []])
    with pytest.raises(StateError, match="'w' has global shape"):
        plan_arrays([[_info("w", (4,), Box((0,), (4,)))], [_info("w", (5,), Box((0,), (5,)))]])
    with pytest.raises(StateError, match="do not tile it exactly"):
        plan_arrays([[_info("w", (4,), Box((0,), (3,)))], [_info("w", (4,), Box((0,), (3,)))]])


def test_inner_chunks_divide_the_shard_and_respect_the_target():
    inner = choose_inner_shape((4096, 4096), 4, 4 << 20)
    assert inner == (256, 4096)
    inner = choose_inner_shape((7, 1 << 22), 2, 1 << 20)  # dim 0 cannot go below 1 row -> dim 1 splits
    assert inner[0] == 1 and (1 << 22) % inner[1] == 0 and inner[1] * 2 <= 1 << 20
