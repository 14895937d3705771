"""Configuration of a Checkpointer."""

from __future__ import annotations

from dataclasses import dataclass

from resilient.errors import ConfigError
from resilient.layout import DEFAULT_INNER_CHUNK_BYTES, DEFAULT_MAX_SHARD_BYTES


@dataclass(kw_only=True, slots=True)
class CheckpointerConfig:
    keep_last: int | None = None
    """Committed steps to keep (None: all). Older steps and orphan attempts go after a commit."""
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES
    """Target size of an inner (checksummed, independently readable) chunk, 64 KiB .. 256 MiB."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest shard object, 1 MiB .. 4 GiB (S3 PUTs one object whole, up to 5 GiB)."""
    commit_timeout_s: float = 600.0
    """How long the coordinator waits for every rank's receipt before giving up on a save."""
    load_budget_bytes: int = 1 << 30
    """Bytes of reads kept in flight during load (bounds the extra memory a load needs)."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ConfigError(f"keep_last must be None or an integer >= 1, got {self.keep_last!r}")
        if not 64 << 10 <= self.inner_chunk_bytes <= 256 << 20:
            raise ConfigError(f"inner_chunk_bytes must be in [64 KiB, 256 MiB], got {self.inner_chunk_bytes}")
        if not 1 << 20 <= self.max_shard_bytes <= 4 << 30:
            raise ConfigError(f"max_shard_bytes must be in [1 MiB, 4 GiB], got {self.max_shard_bytes}")
        if self.max_shard_bytes < self.inner_chunk_bytes:
            raise ConfigError("max_shard_bytes must be >= inner_chunk_bytes")
        if not self.commit_timeout_s > 0:
            raise ConfigError(f"commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        if self.load_budget_bytes < 1 << 20:
            raise ConfigError(f"load_budget_bytes must be >= 1 MiB, got {self.load_budget_bytes}")
