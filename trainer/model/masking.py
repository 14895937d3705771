"""Which token may see which, and which tokens are trained on what: pure functions of the batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from resilient.trainer.model.batch import Modality


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask [B, 1, L, L]; True where query i may attend to key j.

    A token sees earlier tokens (and itself) of its own document only, so packing several documents
    into a row changes nothing any document computes. A padding query (doc id -1) sees only itself:
    a row of all-False would make softmax 0/0 = NaN, and NaN in a padding row still poisons the
    gradients through the backward of the attention matmuls. No real query ever sees a padding key
    because real doc ids are >= 0.
    """
    length = doc_ids.shape[1]
    same_doc = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    real_query = (doc_ids >= 0).unsqueeze(2)
    diagonal = torch.eye(length, dtype=torch.bool, device=doc_ids.device)
    return ((same_doc & causal & real_query) | diagonal).unsqueeze(1)


class LossTargets(NamedTuple):
    """Boolean masks [B, L-1] over *input* positions 0..L-2; the target is the token at i + 1."""

    text: torch.Tensor
    """The next token is text in the same document: predict its id (cross-entropy)."""
    audio: torch.Tensor
    """This token and the next are audio of the same document: predict the next frame (MSE)."""
    video: torch.Tensor
    """This token and the next are video of the same document: predict the next patch (MSE)."""


def loss_targets(modality: torch.Tensor, doc_ids: torch.Tensor) -> LossTargets:
    """The three target masks; they are disjoint, so each input position counts at most once."""
    same_doc_next = (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    current, following = modality[:, :-1], modality[:, 1:]
    same_modality_next = same_doc_next & (current == following)
    return LossTargets(
        text=same_doc_next & (following == Modality.TEXT),
        audio=same_modality_next & (current == Modality.AUDIO),
        video=same_modality_next & (current == Modality.VIDEO),
    )


def count_loss_tokens(batch: dict[str, object]) -> torch.Tensor:
    """int64 scalar: positions of ``batch`` that contribute to the loss (what forward's
    ``num_loss_tokens`` will be). Lets a trainer all-reduce the global count *before* the forward pass
    and pass it as ``loss_normalizer``."""
    targets = loss_targets(batch["modality"], batch["doc_ids"])
    return targets.text.sum() + targets.audio.sum() + targets.video.sum()
