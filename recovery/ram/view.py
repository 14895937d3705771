"""What the restore decision and the buddy handler read of the RAM tier: a read-only view it builds.

The tier runs the lifecycle (start, snapshot, publish, replicate); the collective restore decision
(``ram.restore``) and the buddy side (``ram.buddy``) only read this rank's place (rank, pairing),
its node's stores, the timeline and topology a snapshot must match, and how to reach another rank.
Handing them this view instead of the tier keeps them off its internals, and keeps the three
modules out of an import circle (the tier imports them; they import this).

A view is a picture of the tier when it was built: the place and the stores do not change once the
tier started; the timeline is the one of that moment (the restore decision builds its view when it
begins, after the restore policy set it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilient.recovery.channel import ReplicationClient
from resilient.recovery.ram.pairing import Pairing
from resilient.recovery.ram.store import NodeStores, RankStore
from resilient.recovery.timeline import Timeline


@dataclass(frozen=True, slots=True)
class RamView:
    """This rank's side of the RAM tier, read-only; built by ``RamTier.view``."""

    rank: int
    pairing: Pairing
    """Who holds whose copies: a rank's buddy, the ranks it keeps copies of, the ranks of a node."""
    own: RankStore
    """This rank's own snapshots (the tier's store, the one it snapshots into)."""
    stores: NodeStores
    """Every rank's stores on this node, by rank: the copies kept for it, the own store it left here."""
    timeline: Timeline
    """The run and timeline a snapshot must carry to restore."""
    topology: dict[str, Any]
    """What a snapshot must have been taken on (world size, ranks per node, group, mesh)."""
    connect: Callable[[int], ReplicationClient] = field(repr=False)
    """A new channel client to that rank's server (the restore fetches a buddy copy with it)."""

    @property
    def node_ranks(self) -> list[int]:
        """The ranks of this rank's node, in rank order."""
        return self.pairing.ranks_on(self.pairing.node_of(self.rank))

    def copies_of(self, rank: int) -> list[RankStore]:
        """The stores of this node that may hold ``rank``'s snapshots besides its own store: the
        copies kept for it, and, when ``rank`` now runs on another node (ranks were renumbered), the
        own store it left here."""
        stores = [self.stores.kept(rank)]
        if rank not in self.node_ranks:
            stores.append(self.stores.own(rank))
        return stores

    def left_here(self) -> list[int]:
        """The ranks with a store on this node that no rank of this node keeps now (taken under
        another numbering); reported by the node's first rank only, so each is offered once."""
        here = self.node_ranks
        if self.rank != here[0]:
            return []
        world = self.pairing.world_size
        kept = {r for r in range(world) if self.pairing.buddy_of(r) in here}
        found = {r for r in self.stores.ranks("own") if r < world and r not in here}
        found |= {r for r in self.stores.ranks("buddy") if r < world and r not in kept}
        return sorted(found)
