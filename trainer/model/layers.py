"""Building blocks of the omni decoder: RMSNorm, rotary embedding, attention, SwiGLU MLP, the block.

No parallelism here. Tensor parallelism is applied from outside (``resilient.trainer.parallelize``) by
module name, so the layers keep to two rules that make that possible: every matrix is its own
``nn.Linear`` with a stable name, and attention never assumes how many heads it holds locally (it
reshapes with ``-1``), because a column-sharded ``wq`` returns only this rank's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from resilient.trainer.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019); statistics in fp32 whatever the compute dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim // 2] in fp32 (RoFormer, Su et al. 2021)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, L, H, head_dim] by per-token angles; cos/sin are [B, L, 1, head_dim // 2].

    The angles come from each token's *temporal* position, not its index in the packed row: audio and
    video tokens of one time step share a position (time-aligned positions as in Qwen2.5-Omni), and
    every document starts again at 0, so packing does not change what a document sees.
    Half-split pairing (GPT-NeoX layout): dimension i is rotated with dimension i + head_dim / 2.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Grouped-query self-attention under a boolean mask (document-causal, built by the model)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, head_dim, kv_heads = config.dim, config.head_dim, config.n_kv_heads
        dtype = config.torch_dtype
        self.head_dim = head_dim
        # Query heads per key/value head: the same on every tensor-parallel rank when tp divides both.
        self.kv_repeat = config.n_heads // kv_heads
        self.wq = nn.Linear(dim, config.n_heads * head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(config.n_heads * head_dim, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.wq(x).view(batch, length, -1, self.head_dim)
        k = self.wk(x).view(batch, length, -1, self.head_dim)
        v = self.wv(x).view(batch, length, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=1)
            v = v.repeat_interleave(self.kv_repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x) (Shazeer 2020)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, hidden, dtype = config.dim, config.ffn_hidden_dim, config.torch_dtype
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, dtype)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, dtype)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))
