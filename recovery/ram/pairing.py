"""Which rank keeps whose RAM snapshot: deterministic, and never on the same node.

Ranks are laid out node by node (torchrun's order: node n holds ranks n*P .. n*P+P-1). Rank r's
buddy is the rank with the same local index on the NEXT node of the ring, so:

- a lost node's ranks find every copy on one surviving node, and that node keeps copies of no
  more than one other node (memory per node: own + one node's worth);
- with ``failure_domains`` (one label per node, e.g. its rack), the buddy node is the next one in a
  DIFFERENT domain, so losing a whole domain still leaves each lost rank's copy alive;
- a single node (or a single domain) has no buddy: the tier is then node-local only.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilient.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Pairing:
    world_size: int
    ranks_per_node: int
    failure_domains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ConfigError(f"ranks_per_node={self.ranks_per_node} must divide the world size {self.world_size}")
        if self.failure_domains and len(self.failure_domains) != self.nodes:
            labels = len(self.failure_domains)
            raise ConfigError(
                f"recovery.failure_domains has {labels} labels for {self.nodes} nodes: give one "
                f"per node ({self.world_size} ranks / {self.ranks_per_node} per node)"
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

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
        node = self.buddy_node(self.node_of(rank))
        return None if node is None else node * self.ranks_per_node + rank % self.ranks_per_node

    def kept_by(self, rank: int) -> list[int]:
        """The ranks whose snapshots ``rank`` keeps."""
        return [r for r in range(self.world_size) if self.buddy_of(r) == rank]
