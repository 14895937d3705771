"""The omni model's configuration and the arithmetic that follows from it (parameter and FLOP counts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from resilient.errors import ConfigError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16")
"""Parameter dtypes by name (``torch.<name>``). Names, not torch objects: the launcher checks a
recipe without importing torch."""


def _swiglu_hidden_dim(dim: int, multiple_of: int = 64) -> int:
    # SwiGLU has three matrices instead of two; 2/3 of 4*dim keeps the MLP's parameter count equal to a
    # plain 4*dim GELU MLP (Shazeer 2020, "GLU Variants Improve Transformer"); rounded for matmul shapes.
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape and training constants of the omni decoder. ``None`` fields are resolved in ``__post_init__``."""

    dim: int = 256
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer; ``dim`` must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means ``n_heads``. Must divide ``n_heads``."""
    ffn_hidden_dim: int | None = None
    """Hidden width of the SwiGLU MLP; ``None`` means 8/3·dim rounded up to a multiple of 64."""
    vocab_size: int = 4096
    """Text vocabulary size (rows of the text embedding, columns of the text head)."""
    audio_dim: int = 80
    """Features per audio frame (e.g. mel bins)."""
    video_dim: int = 192
    """Values per video patch (e.g. 8x8 RGB)."""
    max_positions: int = 4096
    """Largest temporal position index + 1 that rotary embedding supports."""
    rope_theta: float = 10000.0
    """Rotary embedding base (Su et al. 2021, RoFormer)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    media_loss_weight: float = 0.1
    """Weight of the summed next-frame MSE relative to the summed text cross-entropy."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every matrix and embedding."""
    dtype: str = "float32"
    """Parameter dtype when the model runs without a mixed-precision policy: 'float32' or 'bfloat16'."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "audio_dim", "video_dim", "max_positions"):
            _require_positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _require_positive_int("n_kv_heads", self.n_kv_heads)
        if self.ffn_hidden_dim is None:
            self.ffn_hidden_dim = _swiglu_hidden_dim(self.dim)
        _require_positive_int("ffn_hidden_dim", self.ffn_hidden_dim)
        if self.dim % self.n_heads:
            raise ConfigError(f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(
                f"ModelConfig.dim / n_heads = {self.head_dim} must be even (rotary embedding rotates pairs)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (1..n_heads)"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ModelConfig.{name}={getattr(self, name)} must be > 0")
        if not self.media_loss_weight >= 0:
            raise ConfigError(f"ModelConfig.media_loss_weight={self.media_loss_weight} must be >= 0")
        if self.dtype not in DTYPES:
            raise ConfigError(f"ModelConfig.dtype={self.dtype!r} must be one of {sorted(DTYPES)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # deferred: see DTYPES

        return getattr(torch, self.dtype)


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"ModelConfig.{name}={value!r} must be an integer >= 1")


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters by kind: 'embedding' (lookup tables) and 'dense' (everything that is a matmul or a norm)."""
    dim, kv_dim = config.dim, config.n_kv_heads * config.head_dim
    attention = 2 * dim * dim + 2 * dim * kv_dim  # wq, wo + wk, wv
    mlp = 3 * dim * config.ffn_hidden_dim
    block = attention + mlp + 2 * dim  # + two RMSNorm weights
    projections = (config.audio_dim + config.video_dim) * dim
    heads = dim * (config.vocab_size + config.audio_dim + config.video_dim)
    return {
        "embedding": config.vocab_size * dim + 4 * dim,  # text tokens + the 4 modality rows
        "dense": config.n_layers * block + projections + heads + dim,  # + final norm
    }


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward) for MFU, as in nanochat / torchtitan.

    6·N for the dense parameters (2 forward, 4 backward per multiply-add; embedding lookups are not
    matmuls) plus 12·layers·heads·head_dim·seq_len for the attention scores and weighted sum (Kaplan et
    al. 2020, Table 1). The estimate counts full (not causal or document-masked) attention, and every
    head on every token, like the references; it is an upper bound meant for comparing runs.
    """
    if seq_len < 1:
        raise ConfigError(f"flops_per_token: seq_len={seq_len} must be >= 1")
    dense = parameter_counts(config)["dense"]
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return 6 * dense + attention
