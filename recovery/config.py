"""``[replica]``: replica groups across which torchft keeps training through group loss.

Kept free of torchft imports: the trainer's config loads it whether or not replication is on.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from resilient.errors import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""Where the launcher puts the lighthouse URL (torchft's own Manager reads the same variable)."""


def _check_seconds(key: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"replica.{key}={value!r} must be a number of seconds in [{low}, {high}]")
    if not low <= value <= high:
        raise ConfigError(f"replica.{key}={value} is out of range: allowed [{low}, {high}] seconds")


def _check_int(key: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"replica.{key}={value!r} must be an integer in [{low}, {high}]")


@dataclass(kw_only=True, slots=True)
class QuorumConfig:
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
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"replica.enabled={self.enabled!r} must be true or false")
        _check_int("groups", self.groups, 1, 4096)
        if not isinstance(self.lighthouse, str):
            raise ConfigError(f"replica.lighthouse={self.lighthouse!r} must be a URL string")
        if self.lighthouse and not self.lighthouse.startswith(("http://", "https://")):
            raise ConfigError(f"replica.lighthouse={self.lighthouse!r} must look like http://HOST:PORT")
        _check_int("min_replica_size", self.min_replica_size, 1, max(self.groups, 1))
        _check_seconds("quorum_timeout_s", self.quorum_timeout_s, 1.0, 86400.0)
        _check_int("quorum_retries", self.quorum_retries, 1, 10_000)
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
