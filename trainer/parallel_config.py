"""How one replica group splits the model: the ``[parallel]`` recipe section and its checks.

Kept apart from ``parallelize`` (which applies it with torch.distributed) so that the launcher can
check a recipe without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilient.errors import ConfigError

MESH_DIM_NAMES = ("dp_shard", "tp")
"""The dims every stage's parameters live on (a pipeline stage is one ``dp_shard x tp`` mesh)."""
FULL_MESH_DIM_NAMES = ("pp", *MESH_DIM_NAMES)
"""The group's whole mesh: pipeline stages outermost, tensor parallelism innermost."""
ACTIVATION_CHECKPOINTING = ("none", "full")
MIXED_PRECISION = ("off", "bf16")
PP_SCHEDULES = {"1F1B": 1, "interleaved1F1B": 2}
"""Pipeline schedules by name, and how many stages each puts on one rank."""


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How one replica group splits the model over its ``pp × dp_shard × tp`` ranks."""

    pp: int = 1
    """Pipeline-parallel degree: ranks that each run a contiguous slice of the layers (a stage) on the
    same data, handing activations on; 1 turns pipelining off."""
    pp_schedule: str = "1F1B"
    """'1F1B' (one stage per rank) or 'interleaved1F1B' (two stages per rank, a smaller bubble;
    needs n_layers >= 2·pp)."""
    pp_microbatches: int = 0
    """Microbatches each rank's share of a global batch is split into under pipelining; 0: 2·pp
    (the schedule's bubble is (pp - 1) / (microbatches + pp - 1) for 1F1B)."""
    sequence_parallel: bool = False
    """Shard the norms' and residual stream's activations along the sequence between the
    tensor-parallel regions (Korthikanti et al. 2022); needs tp > 1 and tp dividing data.row_len."""
    cp: int = 1
    """Context-parallel degree (long rows split over ranks). Only 1: see ``check_context_parallel``."""
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
        for name in ("pp", "dp_shard", "tp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ParallelConfig.{name}={value!r} must be an integer >= 1")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(
                f"ParallelConfig.activation_checkpointing={self.activation_checkpointing!r} "
                f"must be one of {list(ACTIVATION_CHECKPOINTING)}"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"ParallelConfig.pp_schedule={self.pp_schedule!r} must be one of {list(PP_SCHEDULES)}")
        if (
            not isinstance(self.pp_microbatches, int)
            or isinstance(self.pp_microbatches, bool)
            or self.pp_microbatches < 0
        ):
            raise ConfigError(
                f"ParallelConfig.pp_microbatches={self.pp_microbatches!r} must be an integer >= 0 (0: 2 x pp)"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"ParallelConfig.sequence_parallel={self.sequence_parallel!r} must be true or false")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "ParallelConfig.sequence_parallel=true needs tp > 1 (it shards the activations between "
                "tensor-parallel regions): set parallel.tp, or parallel.sequence_parallel=false"
            )
        check_context_parallel(self.cp)
        if self.mixed_precision not in MIXED_PRECISION:
            raise ConfigError(
                f"ParallelConfig.mixed_precision={self.mixed_precision!r} must be one of {list(MIXED_PRECISION)}"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_shard * self.tp

    @property
    def stages_per_rank(self) -> int:
        return PP_SCHEDULES[self.pp_schedule] if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def microbatches(self) -> int:
        """Microbatches per step under pipelining (1 without it)."""
        if self.pp == 1:
            return 1
        return self.pp_microbatches or 2 * self.pp

    def describe(self) -> str:
        """The layout as the run's messages name it, e.g. 'pp=2 x dp_shard=2 x tp=1'."""
        return (
            f"pp={self.pp} x dp_shard={self.dp_shard} x tp={self.tp}"
            if self.pp > 1
            else (f"dp_shard={self.dp_shard} x tp={self.tp}")
        )


def check_context_parallel(cp: int) -> None:
    """Context parallelism stays off: torch 2.13's ring attention cannot run this model.

    Measured on torch 2.13 (docs/parallelism.md): ``context_parallel`` dispatches only the CUDA
    flash / memory-efficient / cuDNN SDPA ops (the CPU kernel fails with "does not have a sharding
    strategy registered"), its ring loop supports ``is_causal`` only, and every ring handler rejects
    an attention mask ("attn_bias is not supported yet"), while this model's attention is
    document-causal under a boolean mask (packed rows).
    """
    if cp != 1:
        raise ConfigError(
            f"ParallelConfig.cp={cp}: context parallelism is not supported: torch 2.13's ring attention "
            "(context_parallel) runs only CUDA flash/efficient/cuDNN attention with is_causal=True and "
            "takes no attention mask, and this model masks attention per document; set parallel.cp=1 and "
            "shard long rows' activations with parallel.sequence_parallel=true (tp > 1)"
        )


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
