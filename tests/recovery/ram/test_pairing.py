"""Which rank keeps whose snapshot (``recovery/ram/pairing.py``)."""

from __future__ import annotations

import pytest

from resilient.errors import ConfigError
from resilient.recovery.ram.pairing import Pairing


def test_pairing_puts_every_buddy_on_another_node_and_domain():
    ring = Pairing(world_size=6, ranks_per_node=2)
    assert [ring.buddy_of(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert ring.kept_by(2) == [0] and ring.kept_by(0) == [4]
    racks = Pairing(world_size=4, ranks_per_node=1, failure_domains=("a", "a", "b", "b"))
    assert [racks.buddy_of(r) for r in range(4)] == [2, 2, 0, 0]
    assert all(racks.failure_domains[racks.buddy_of(r)] != racks.failure_domains[r] for r in range(4))
    assert Pairing(world_size=4, ranks_per_node=4).buddy_of(1) is None
    with pytest.raises(ConfigError, match="must divide the world size 6"):
        Pairing(world_size=6, ranks_per_node=4)
