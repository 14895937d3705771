"""The omni decoder: modality input projections, a pre-norm transformer, text and next-frame heads.

Parallelization surface (the only names ``resilient.trainer.parallelize`` relies on):

- ``model.config``: the :class:`ModelConfig` (head counts, widths, vocabulary);
- ``model.layers``: ``nn.ModuleDict`` of :class:`TransformerBlock`, keyed ``"0"``, ``"1"``, ...; each has
  ``attention.{wq,wk,wv,wo}`` and ``feed_forward.{w1,w2,w3}`` (``nn.Linear``) plus ``attention_norm``,
  ``ffn_norm``;
- ``model.tok_embeddings`` (``nn.Embedding`` over the vocabulary) and ``model.text_head`` (``nn.Linear``
  to the vocabulary);
- every other parameter lives in a leaf module that takes and returns one tensor (norms, the modality
  embedding, the audio/video projections and heads) and can be computed redundantly.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from resilient.errors import ConfigError
from resilient.trainer.model.batch import Modality
from resilient.trainer.model.config import ModelConfig
from resilient.trainer.model.layers import RMSNorm, TransformerBlock, rope_tables
from resilient.trainer.model.masking import document_causal_mask, loss_targets


class OmniOutput(NamedTuple):
    """What one forward pass returns. A NamedTuple (a pytree) so FSDP's hooks see the loss tensor.

    ``loss`` = (text_loss_sum + media_loss_weight · media_loss_sum) / loss_normalizer.
    Everything but ``loss`` is detached and meant for logging or for all-reducing across ranks.
    """

    loss: torch.Tensor
    """Scalar, differentiable."""
    text_loss: torch.Tensor
    """Local mean cross-entropy per text target (0 when there is none)."""
    media_loss: torch.Tensor
    """Local mean next-frame MSE per audio/video target (0 when there is none)."""
    num_loss_tokens: torch.Tensor
    """int64 scalar: local count of positions that contribute to the loss (text + media targets)."""
    text_loss_sum: torch.Tensor
    """Summed cross-entropy over local text targets (fp32)."""
    media_loss_sum: torch.Tensor
    """Summed per-token MSE over local audio/video targets (fp32)."""
    num_text_tokens: torch.Tensor
    """int64 scalar: local count of text targets."""
    num_media_tokens: torch.Tensor
    """int64 scalar: local count of audio/video targets."""


class OmniModel(nn.Module):
    """Decoder-only transformer over interleaved text, audio frames and video patches."""

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        dim, dtype = config.dim, config.torch_dtype
        self.tok_embeddings = nn.Embedding(config.vocab_size, dim, dtype=dtype)
        self.modality_embeddings = nn.Embedding(len(Modality), dim, dtype=dtype)
        self.audio_proj = nn.Linear(config.audio_dim, dim, bias=False, dtype=dtype)
        self.video_proj = nn.Linear(config.video_dim, dim, bias=False, dtype=dtype)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = RMSNorm(dim, config.norm_eps, dtype)
        self.text_head = nn.Linear(dim, config.vocab_size, bias=False, dtype=dtype)
        self.audio_head = nn.Linear(dim, config.audio_dim, bias=False, dtype=dtype)
        self.video_head = nn.Linear(dim, config.video_dim, bias=False, dtype=dtype)
        # Derived from the config, never trained: kept out of the state dict (persistent=False) so a
        # checkpoint holds only what training changes, and rebuilt by init_weights.
        self.register_buffer("rope_cos", torch.empty(config.max_positions, config.head_dim // 2), False)
        self.register_buffer("rope_sin", torch.empty(config.max_positions, config.head_dim // 2), False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed``, on the full (not yet parallelized) model.

        Each parameter draws from its own generator seeded by (seed, FQN), so its values depend on
        neither the order of modules nor the global RNG, and adding a module changes no other weight.
        Residual-branch outputs (wo, w2) are scaled by 1/sqrt(2·n_layers) (GPT-2, Radford et al. 2019)
        so the residual stream's variance does not grow with depth.
        """
        if not 0 <= seed < 2**31:
            raise ConfigError(f"OmniModel seed={seed} must lie in [0, 2**31)")
        cos, sin = rope_tables(self.config.head_dim, self.config.max_positions, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else self.config.init_std
            # One 32-bit value: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
            param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, batch: dict[str, object], loss_normalizer: float | torch.Tensor | None = None) -> OmniOutput:
        """Loss of one batch (see :mod:`resilient.trainer.model.batch` for the contract).

        ``loss_normalizer``: what the summed loss is divided by. Default: the local count of
        contributing tokens (a per-rank mean). A data-parallel trainer passes the global count over
        all data-parallel ranks instead, so that summing gradients across ranks gives the gradient of
        the global mean loss whatever each rank's share of tokens. Values below 1 are taken as 1.
        """
        hidden = self.run_blocks(self.embed(batch), batch, self.layers.values())
        return self.head_loss(hidden, batch, loss_normalizer)

    def features(self, batch: dict[str, object]) -> torch.Tensor:
        """Final-norm hidden states [B, L, dim]. Call through ``forward`` once the model is sharded."""
        return self.norm(self.run_blocks(self.embed(batch), batch, self.layers.values()))

    # The three parts of ``forward``, each touching only its own modules, so that a copy of the model
    # that holds some of them (a pipeline stage, built outside this package) can run its part.

    def embed(self, batch: dict[str, object]) -> torch.Tensor:
        """The residual stream's input [B, L, dim]: token, audio and video embeddings plus modality."""
        modality = batch["modality"]
        # Inputs of other modalities are 0 by contract; masking anyway keeps a stray value (or the
        # token-0 embedding looked up at every non-text position) out of the residual stream.
        dtype = self.audio_proj.weight.dtype
        text = self.tok_embeddings(batch["text_tokens"]) * (modality == Modality.TEXT).unsqueeze(-1)
        audio = self.audio_proj(batch["audio_frames"].to(dtype)) * (modality == Modality.AUDIO).unsqueeze(-1)
        video = self.video_proj(batch["video_patches"].to(dtype)) * (modality == Modality.VIDEO).unsqueeze(-1)
        return (text + audio + video).to(dtype) + self.modality_embeddings(modality)

    def run_blocks(self, hidden: torch.Tensor, batch: dict[str, object], blocks: Iterable[nn.Module]) -> torch.Tensor:
        """``hidden`` through ``blocks`` (in order) under the batch's positions and document mask."""
        positions = batch["positions"]
        # Gather the tables at temporal positions; unsqueeze for the heads dimension.
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        mask = document_causal_mask(batch["doc_ids"])
        for block in blocks:
            hidden = block(hidden, cos, sin, mask)
        return hidden

    def head_loss(
        self, hidden: torch.Tensor, batch: dict[str, object], loss_normalizer: float | torch.Tensor | None
    ) -> OmniOutput:
        """Final norm, heads and loss of the last block's output (see ``forward``)."""
        return self._loss(self.norm(hidden), batch, loss_normalizer)

    def _loss(
        self, hidden: torch.Tensor, batch: dict[str, object], loss_normalizer: float | torch.Tensor | None
    ) -> OmniOutput:
        targets = loss_targets(batch["modality"], batch["doc_ids"])
        inputs = hidden[:, :-1]
        # Heads run on the selected positions only (the text head is the largest matmul), but always
        # run, even on zero rows: a rank skipping a sharded module would hang its peers' collectives.
        logits = self.text_head(inputs[targets.text]).float()
        text_sum = F.cross_entropy(logits, batch["text_tokens"][:, 1:][targets.text], reduction="sum")
        media_sum = self._frame_loss_sum(self.audio_head, inputs, batch["audio_frames"], targets.audio)
        media_sum = media_sum + self._frame_loss_sum(self.video_head, inputs, batch["video_patches"], targets.video)
        num_text = targets.text.sum()
        num_media = targets.audio.sum() + targets.video.sum()
        num_tokens = num_text + num_media
        # A token count, at least 1: a batch (or a whole global step) without targets gives 0, not NaN.
        normalizer = torch.as_tensor(num_tokens if loss_normalizer is None else loss_normalizer)
        normalizer = normalizer.detach().float().clamp(min=1)
        loss = (text_sum + self.config.media_loss_weight * media_sum) / normalizer
        text_sum, media_sum = text_sum.detach(), media_sum.detach()
        return OmniOutput(
            loss=loss,
            text_loss=text_sum / num_text.clamp(min=1),
            media_loss=media_sum / num_media.clamp(min=1),
            num_loss_tokens=num_tokens,
            text_loss_sum=text_sum,
            media_loss_sum=media_sum,
            num_text_tokens=num_text,
            num_media_tokens=num_media,
        )

    @staticmethod
    def _frame_loss_sum(
        head: nn.Module, inputs: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Sum over masked positions of the per-token MSE (mean over features) to the next frame."""
        prediction = head(inputs[mask]).float()
        target = frames[:, 1:][mask].float()
        return (prediction - target).pow(2).mean(-1).sum()
