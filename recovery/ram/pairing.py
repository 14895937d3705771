"""Which rank keeps whose RAM snapshot: deterministic, and never on the same node.

A node is either a real machine, named by its identity (``ram.node_id``: node n is the n-th of the
sorted distinct identities, recomputed at every start, so a rendezvous that renumbers ranks or
nodes does not move a node), or, when every rank reports the same identity (one machine), a
simulated one of ``ranks_per_node`` consecutive ranks (node n holds ranks n*P .. n*P+P-1). Rank
r's buddy is the rank with the same local index (its position among its node's ranks, in rank
order) on the NEXT node of the ring, so:

- a lost node's ranks find every copy on one surviving node, and that node keeps copies of no
  more than one other node (memory per node: own + one node's worth);
- with ``failure_domains`` (one label per node, e.g. its rack), the buddy node is the next one in a
  DIFFERENT domain, so losing a whole domain still leaves each lost rank's copy alive;
- a single node (or a single domain) has no buddy: the tier is then node-local only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from resilient.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Pairing:
    world_size: int
    ranks_per_node: int
    failure_domains: tuple[str, ...] = ()
    identities: tuple[str, ...] = ()
    """Every rank's node identity, in rank order (``from_identities``); empty: simulated nodes."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ConfigError(f"ranks_per_node={self.ranks_per_node} must divide the world size {self.world_size}")
        if self.failure_domains and len(self.failure_domains) != self.nodes:
            labels = len(self.failure_domains)
            raise ConfigError(
                f"recovery.failure_domains has {labels} labels for {self.nodes} nodes: give one "
                f"per node ({self.world_size} ranks / {self.ranks_per_node} per node)"
            )

    @classmethod
    def from_identities(cls, identities: list[str], failure_domains: tuple[str, ...] = ()) -> Pairing:
        """Nodes from every rank's identity (rank order); every node must hold as many ranks."""
        counts = Counter(identities)
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{name}={n}" for name, n in sorted(counts.items()))
            raise ConfigError(
                f"RAM tier nodes hold unequal rank counts ({listed}): every node (RESILIENT_NODE_ID or "
                f"host name) must run the same number of ranks, or set checkpoint.memory_every=0"
            )
        return cls(len(identities), next(iter(counts.values())), failure_domains, tuple(identities))

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node_names(self) -> tuple[str, ...]:
        """The sorted distinct identities (node n is the n-th); empty for simulated nodes."""
        return tuple(sorted(set(self.identities)))

    def node_of(self, rank: int) -> int:
        if self.identities:
            return self.node_names.index(self.identities[rank])
        return rank // self.ranks_per_node

    def ranks_on(self, node: int) -> list[int]:
        """The ranks of ``node``, in rank order (their local indexes are their positions here)."""
        if self.identities:
            return [r for r, name in enumerate(self.identities) if name == self.node_names[node]]
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def buddy_node(self, node: int) -> int | None:
        """The next node of the ring in another failure domain; None if there is none."""
        domains = self.failure_domains or tuple(str(n) for n in range(self.nodes))
        for step in range(1, self.nodes):
            other = (node + step) % self.nodes
            if domains[other] != domains[node]:
                return other
        return None

    def buddy_of(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s snapshots."""
        node = self.node_of(rank)
        buddy = self.buddy_node(node)
        return None if buddy is None else self.ranks_on(buddy)[self.ranks_on(node).index(rank)]

    def kept_by(self, rank: int) -> list[int]:
        """The ranks whose snapshots ``rank`` keeps."""
        return [r for r in range(self.world_size) if self.buddy_of(r) == rank]
