"""How one replica group splits the model: the ``[parallel]`` recipe section and its checks.

Kept apart from ``parallelize`` (which applies it with torch.distributed) so that the launcher can
check a recipe without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilient.errors import ConfigError

MESH_DIM_NAMES = ("dp_shard", "tp")
ACTIVATION_CHECKPOINTING = ("none", "full")
MIXED_PRECISION = ("off", "bf16")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How one replica group splits the model over its ``dp_shard × tp`` ranks."""

    dp_shard: int = 1
    """FSDP2 degree: ranks that each hold 1/dp_shard of every parameter and see different data."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split heads / hidden units and see the same data."""
    activation_checkpointing: str = "none"
    """'none', or 'full': recompute each transformer block in backward instead of storing activations."""
    mixed_precision: str = "off"
    """'off' (compute in the parameters' dtype) or 'bf16' (bf16 compute, fp32 master weights and
    fp32 gradient reduction, via FSDP2's MixedPrecisionPolicy)."""

    def __post_init__(self) -> None:
        for name in ("dp_shard", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ParallelConfig.{name}={value!r} must be an integer >= 1")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(
                f"ParallelConfig.activation_checkpointing={self.activation_checkpointing!r} "
                f"must be one of {list(ACTIVATION_CHECKPOINTING)}"
            )
        if self.mixed_precision not in MIXED_PRECISION:
            raise ConfigError(
                f"ParallelConfig.mixed_precision={self.mixed_precision!r} must be one of {list(MIXED_PRECISION)}"
            )

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.tp


def check_model_compatible(config: ParallelConfig, model_config: object) -> None:
    """Raise ConfigError unless tp divides every dimension it splits (heads, MLP width, vocabulary).

    ``model_config`` needs ``n_heads``, ``n_kv_heads``, ``ffn_hidden_dim`` and ``vocab_size``.
    """
    for field in ("n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size"):
        size = getattr(model_config, field)
        if size % config.tp:
            divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise ConfigError(
                f"ParallelConfig.tp={config.tp} must divide ModelConfig.{field}={size} "
                f"(tensor parallelism splits it evenly); tp values that fit: {divisors}"
            )
