"""resilient/dist.py: JSON all-gather in one collective when every text fits its slot, two when not."""

from __future__ import annotations

import pytest

from tests.dist import run_world

pytestmark = pytest.mark.timeout(120)


def _gather_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from resilient import dist as rdist

    calls = []
    real = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(args[1].numel())
        return real(*args, **kwargs)

    dist.all_gather = counting
    inline = rdist.slot_bytes(2) - rdist._HEADER
    # JSON text of a string of n characters is n + 2 bytes (its quotes).
    cases = {
        "small": ["a" * 10, "b" * 3][rank],
        "exactly_fits": "c" * (inline - 2),
        "one_rank_long": ["d" * (inline + 5000), "e"][rank],
        "both_long_uneven": ["f" * (3 * inline), "g" * (inline + 1)][rank],
        "escaped": "é" * (inline // 6 + 1),  # json.dumps writes \u00e9: 6 bytes each; 6 too many
    }
    out = {}
    for name, text in cases.items():
        calls.clear()
        out[name] = {"got": rdist.all_gather_json(text), "collectives": list(calls)}
    dist.all_gather = real
    return out


@pytest.mark.dist
def test_all_gather_json_takes_one_collective_when_the_texts_fit() -> None:
    from resilient import dist as rdist

    inline = rdist.slot_bytes(2) - rdist._HEADER
    results = run_world(_gather_worker, 2, timeout_s=90)
    for out in results:
        assert out["small"] == {"got": ["a" * 10, "b" * 3], "collectives": [rdist.slot_bytes(2)]}
        assert out["exactly_fits"] == {"got": ["c" * (inline - 2)] * 2, "collectives": [rdist.slot_bytes(2)]}
        # A second round carries only the remainder past the slot, padded to the longest one.
        assert out["one_rank_long"]["got"] == ["d" * (inline + 5000), "e"]
        assert out["one_rank_long"]["collectives"] == [rdist.slot_bytes(2), 5002]
        assert out["both_long_uneven"]["got"] == ["f" * (3 * inline), "g" * (inline + 1)]
        assert out["both_long_uneven"]["collectives"] == [rdist.slot_bytes(2), 2 * inline + 2]
        assert out["escaped"]["got"] == ["é" * (inline // 6 + 1)] * 2
        assert out["escaped"]["collectives"] == [rdist.slot_bytes(2), 6]


def test_slots_shrink_as_the_world_grows_so_one_agree_stays_near_1_mib_per_rank() -> None:
    from resilient import dist as rdist

    assert rdist.slot_bytes(1) == rdist.slot_bytes(64) == 16 << 10
    assert rdist.slot_bytes(4096) == 256 and rdist.slot_bytes(16384) == 256
    assert rdist.slot_bytes(1024) == 1024
    assert all(rdist.slot_bytes(w) * w <= (1 << 20) for w in (64, 128, 1000, 4096))
