"""``[recovery]``: where the RAM tier keeps node-local snapshots, and how nodes pair up.

The snapshot cadence itself is ``checkpoint.memory_every`` / ``checkpoint.memory_keep`` (the
trainer's checkpoint section); this section says where and with whom. Kept free of torch imports.

Paths (the contract tools and ``resilient-chaos`` rely on)::

    <store_dir>/group<G>/node<N>/           one simulated or real node of replica group G
        own/rank<R>/step-<S>.json            index of rank R's snapshot of step S (visible = complete)
        own/rank<R>/slot<K>.bin              the bytes, in a reused slot file
        buddy/rank<R>/...                    copies this node keeps for rank R of its buddy node

``store_dir`` defaults to ``/dev/shm/resilient/<run-id>``, run-id a hash of the absolute run.dir,
so a restarted worker of the same run finds it and two runs on one machine never share it.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

from resilient.errors import ConfigError

DEFAULT_STORE_ROOT = "/dev/shm/resilient"


def _check_int(key: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"recovery.{key}={value!r} must be an integer in [{low}, {high}]")


def _check_number(key: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"recovery.{key}={value!r} must be a finite number in [{low}, {high}]")
    if not low <= value <= high:
        raise ConfigError(f"recovery.{key}={value} is out of range: allowed [{low}, {high}]")


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    """The RAM tier's store and buddy replication (active when ``checkpoint.memory_every > 0``)."""

    store_dir: str = ""
    """Root of the node-local stores; empty: ``/dev/shm/resilient/<run-id>``. Must outlive the
    worker processes (tmpfs or a local disk), so a restarted worker finds its snapshots."""
    ranks_per_node: int = 0
    """Ranks per node; 0: torchrun's ``LOCAL_WORLD_SIZE`` (one real node per host). Set it to
    simulate several nodes on one machine: each gets its own store directory and buddy."""
    failure_domains: list[str] = field(default_factory=list)
    """One label per node (e.g. its rack or power domain), in node order; a buddy is always on a
    node with another label. Empty: every node is its own domain."""
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
        _check_int("ranks_per_node", self.ranks_per_node, 0, 1 << 20)
        if not isinstance(self.failure_domains, list) or not all(isinstance(d, str) for d in self.failure_domains):
            raise ConfigError(f"recovery.failure_domains={self.failure_domains!r} must be a list of strings, "
                              "one per node")
        _check_int("max_store_bytes", self.max_store_bytes, 0, 1 << 50)
        if not isinstance(self.replication, bool):
            raise ConfigError(f"recovery.replication={self.replication!r} must be true or false")
        _check_number("replication_bytes_per_s", self.replication_bytes_per_s, 0.0, 1e13)
        _check_number("replication_timeout_s", self.replication_timeout_s, 1.0, 86400.0)
        _check_int("background_nice", self.background_nice, 0, 19)
        if not isinstance(self.bind_host, str):
            raise ConfigError(f"recovery.bind_host={self.bind_host!r} must be a host name or address")
        _check_number("stale_after_s", self.stale_after_s, 60.0, 365 * 86400.0)


def run_id(run_dir: str) -> str:
    """Stable across restarts of one run, different for two runs on one machine."""
    return hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]


def store_root(config: RecoveryConfig, run_dir: str) -> str:
    """``<store_dir>``: the configured one, else ``/dev/shm/resilient/<run-id>``."""
    if config.store_dir:
        return os.path.abspath(config.store_dir)
    return os.path.join(DEFAULT_STORE_ROOT, run_id(run_dir))


def node_store_dir(config: RecoveryConfig, run_dir: str, group: int, node: int) -> str:
    """The directory of node ``node`` of replica group ``group`` (wipe it to simulate losing the node)."""
    return os.path.join(store_root(config, run_dir), f"group{group}", f"node{node}")


def ranks_per_node(config: RecoveryConfig, world_size: int) -> int:
    """Ranks per (simulated) node: the config, else torchrun's LOCAL_WORLD_SIZE, else the world."""
    per_node = config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise ConfigError(
            f"recovery.ranks_per_node={per_node} must divide the group's world size {world_size} "
            f"(every node holds the same number of ranks)"
        )
    return per_node
