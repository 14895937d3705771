"""Save from FSDP2 + TP on 4 ranks; load onto other layouts and world sizes, bit for bit."""

from __future__ import annotations

import pytest

from tests.dist import run_world
from tests.storage.reshard_workers import load_world, save_world

pytestmark = pytest.mark.dist

N_TENSORS = 5 + 5 * 2 + 5  # model params + (exp_avg, exp_avg_sq) + step per param


def _round_trip(url: str, tmp_path, loads: list[tuple[int, str]]) -> list[dict]:
    ref = str(tmp_path / "reference")
    saved = run_world(save_world, 4, url, ref, "tp_a")
    assert saved[0]["steps"] == [7]
    results = []
    for world, layout in loads:
        out = run_world(load_world, world, url, f"{ref}.rank0", layout)
        for r in out:
            assert r["step"] == 7
            assert r["checked"] == N_TENSORS and r["after_set"] == N_TENSORS
            assert r["extra"] == {"epoch": 3, "tag": "reshard-test"}
        results.append(out)
    return results


@pytest.mark.timeout(300)
def test_fsdp_tp_reshard_onto_other_layouts(tmp_path):
    results = _round_trip(str(tmp_path / "ckpt"), tmp_path, [(0, "none"), (2, "fsdp"), (3, "fsdp"), (4, "tp_b")])
    assert [len(r) for r in results] == [1, 2, 3, 4]  # every rank of every world compared its tensors


@pytest.mark.timeout(300)
def test_fsdp_tp_reshard_through_s3(tmp_path, s3_bucket):
    (ranks,) = _round_trip(f"s3://{s3_bucket}/run-7", tmp_path, [(3, "fsdp")])
    assert [r["checked"] for r in ranks] == [N_TENSORS] * 3
