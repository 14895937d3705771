"""``[replica]`` and ``[recovery]``: the recovery package's two config sections.

- ``[replica]`` (``ReplicaConfig``): replica groups across which torchft keeps training through group loss;
- ``[recovery]`` (``RamTierConfig``): where the RAM tier keeps node-local snapshots, and how nodes
  pair up. The snapshot cadence itself is ``checkpoint.memory_every`` / ``checkpoint.memory_keep``
  (the trainer's checkpoint section); this section says where and with whom. The store layout it
  configures is described in ``resilient.recovery.ram.store``.

Kept free of torch and torchft imports: the trainer's config loads both sections whether or not
replication or the RAM tier is on.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from resilient.errors import ConfigError
from resilient.validate import check_bool, check_int, check_number

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""Where the launcher puts the lighthouse URL (torchft's own Manager reads the same variable)."""


def _check_seconds(key: str, value: object, low: float, high: float) -> float:
    return check_number(f"replica.{key}", value, low, high, unit="seconds")


@dataclass(kw_only=True, slots=True)
class ReplicaConfig:
    """One job = ``groups`` replica groups; a step commits on the groups in its torchft quorum."""

    enabled: bool = False
    """Train as one replica group of several (off: the trainer is a plain single-group job)."""
    groups: int = 1
    """Replica groups the job is launched with (``resilient-train --replica-groups``); a step's rows
    are split over the groups participating in it, so every count 1..groups must divide them."""
    lighthouse: str = ""
    """torchft lighthouse URL, e.g. http://127.0.0.1:29510. Empty: ``$TORCHFT_LIGHTHOUSE``."""
    min_replica_size: int = 1
    """Commit a step only when at least this many groups participate in it."""
    quorum_timeout_s: float = 60.0
    """Longest wait for a quorum from the lighthouse; must cover a lighthouse restart."""
    quorum_retries: int = 20
    """Lighthouse RPC retries within quorum_timeout_s. torchft's default 0 makes a lighthouse blip
    crash every group and restart it from step 0 (prototype NOTES §6)."""
    timeout_s: float = 30.0
    """Cross-group all-reduce, should_commit and heal transfer timeout."""
    connect_timeout_s: float = 10.0
    """gRPC connect timeout to the lighthouse and to the group managers."""
    collective_timeout_s: float = 20.0
    """Gloo timeout of one cross-group collective: only a peer that hangs without dying reaches it
    (a dead peer's sockets close at once)."""

    def __post_init__(self) -> None:
        check_bool("replica.enabled", self.enabled)
        check_int("replica.groups", self.groups, 1, 4096)
        if not isinstance(self.lighthouse, str):
            raise ConfigError(f"replica.lighthouse={self.lighthouse!r} must be a URL string")
        if self.lighthouse and not self.lighthouse.startswith(("http://", "https://")):
            raise ConfigError(f"replica.lighthouse={self.lighthouse!r} must look like http://HOST:PORT")
        check_int("replica.min_replica_size", self.min_replica_size, 1, max(self.groups, 1))
        _check_seconds("quorum_timeout_s", self.quorum_timeout_s, 1.0, 86400.0)
        check_int("replica.quorum_retries", self.quorum_retries, 1, 10_000)
        _check_seconds("timeout_s", self.timeout_s, 1.0, 86400.0)
        _check_seconds("connect_timeout_s", self.connect_timeout_s, 1.0, 3600.0)
        _check_seconds("collective_timeout_s", self.collective_timeout_s, 1.0, 86400.0)

    def lighthouse_url(self) -> str:
        """The configured URL, else the environment's; ConfigError when neither names one."""
        url = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not url:
            raise ConfigError(
                f"replica.enabled=true but no lighthouse: set replica.lighthouse=http://HOST:PORT or "
                f"${LIGHTHOUSE_ENV} (resilient-train --replica-groups starts one and sets it)"
            )
        return url


def check_rows_divisible(global_rows: int, dp_shard: int, groups: int) -> None:
    """Every possible participant count k in 1..groups splits a step into k x dp_shard equal shares."""
    bad = [k for k in range(1, groups + 1) if global_rows % (k * dp_shard)]
    if bad:
        raise ConfigError(
            f"data.global_rows={global_rows} must be divisible by participants x parallel.dp_shard for "
            f"every participant count 1..replica.groups={groups} (dp_shard={dp_shard}); it is not for "
            f"{bad}: make global_rows a multiple of {_lcm_upto(groups) * dp_shard}"
        )


def _lcm_upto(n: int) -> int:
    out = 1
    for k in range(2, n + 1):
        out = out * k // math.gcd(out, k)
    return out


@dataclass(kw_only=True, slots=True)
class RamTierConfig:
    """The RAM tier's store and buddy replication (active when ``checkpoint.memory_every > 0``)."""

    store_dir: str = ""
    """Root of the node-local stores; empty: ``/dev/shm/resilient/<run-id>``. Must outlive the
    worker processes (tmpfs or a local disk), so a restarted worker finds its snapshots."""
    ranks_per_node: int = 0
    """Ranks per simulated node, used only when every rank reports the same node identity (one
    machine; ``resilient.recovery.ram.node_id``): set it to simulate several nodes there, each with
    its own store directory and buddy. 0: torchrun's ``LOCAL_WORLD_SIZE``. Ranks on distinct
    identities (``RESILIENT_NODE_ID``, pod, SLURM node or host names) are grouped by identity instead."""
    failure_domains: list[str] = field(default_factory=list)
    """One label per node (e.g. its rack or power domain), in node order (real nodes: their sorted
    identities); a buddy is always on a node with another label. Empty: every node is its own domain."""
    max_store_bytes: int = 0
    """Upper bound on the bytes one node keeps (own + buddy copies); the oldest snapshots go first.
    0: no bound beyond ``checkpoint.memory_keep`` snapshots per rank."""
    replication: bool = True
    """Copy every RAM snapshot to the buddy node (off: a lost node falls back to storage)."""
    replication_bytes_per_s: float = 0.0
    """Bandwidth budget of buddy replication per rank; 0: unlimited."""
    replication_timeout_s: float = 120.0
    """Longest one buddy copy (or fetch) may take before it is abandoned and reported."""
    background_nice: int = 10
    """Nice value of the tier's background threads (checksum, publish, buddy copy, receiving copies):
    they take the CPU time training leaves rather than compete with it; 0 = same priority."""
    bind_host: str = ""
    """Interface the replication channel listens on; empty: the job's own (MASTER_ADDR's), so
    nothing outside the job's network reaches it."""
    stale_after_s: float = 86400.0
    """Stores of other runs untouched this long are removed at start (only directories this code
    created, marked by their ``store.json``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.store_dir, str):
            raise ConfigError(f"recovery.store_dir={self.store_dir!r} must be a path (a string)")
        check_int("recovery.ranks_per_node", self.ranks_per_node, 0, 1 << 20)
        if not isinstance(self.failure_domains, list) or not all(isinstance(d, str) for d in self.failure_domains):
            raise ConfigError(
                f"recovery.failure_domains={self.failure_domains!r} must be a list of strings, one per node"
            )
        check_int("recovery.max_store_bytes", self.max_store_bytes, 0, 1 << 50)
        check_bool("recovery.replication", self.replication)
        check_number("recovery.replication_bytes_per_s", self.replication_bytes_per_s, 0.0, 1e13)
        check_number("recovery.replication_timeout_s", self.replication_timeout_s, 1.0, 86400.0)
        check_int("recovery.background_nice", self.background_nice, 0, 19)
        if not isinstance(self.bind_host, str):
            raise ConfigError(f"recovery.bind_host={self.bind_host!r} must be a host name or address")
        check_number("recovery.stale_after_s", self.stale_after_s, 60.0, 365 * 86400.0)
