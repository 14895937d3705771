"""The batch contract between the omni data pipeline and the model, plus a synthetic batch generator.

A batch is a dict of tensors over ``B`` packed rows of ``L`` tokens:

==================  ===========================  ==========================================================
key                 dtype, shape                 meaning
==================  ===========================  ==========================================================
``text_tokens``     int64 [B, L]                 token id at text positions, 0 elsewhere
``audio_frames``    float32 [B, L, audio_dim]    frame features at audio positions, 0 elsewhere
``video_patches``   float32 [B, L, video_dim]    patch values at video positions, 0 elsewhere
``modality``        int64 [B, L]                 0 pad, 1 text, 2 audio, 3 video (:class:`Modality`)
``positions``       int64 [B, L]                 temporal position index, restarting at 0 per document
``doc_ids``         int64 [B, L]                 document index within the row, -1 on padding
==================  ===========================  ==========================================================

Any other key (``sample_ids``, ...) is ignored by the model.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from resilient.errors import ConfigError
from resilient.trainer.model.config import ModelConfig

BATCH_KEYS = ("text_tokens", "audio_frames", "video_patches", "modality", "positions", "doc_ids")


class Modality(IntEnum):
    PAD = 0
    TEXT = 1
    AUDIO = 2
    VIDEO = 3


def validate_batch(batch: dict[str, object], config: ModelConfig) -> None:
    """Check a batch against the contract; raises ConfigError naming the key. Costs a device sync.

    The forward pass does not call this (it would sync every step); the data pipeline's tests and a
    debug flag in the trainer do.
    """
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise ConfigError(f"batch is missing keys {missing}; the model needs {list(BATCH_KEYS)}")
    tokens = batch["text_tokens"]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ConfigError("batch['text_tokens'] must be an int64 tensor of shape [B, L]")
    shape = tuple(tokens.shape)
    expected = {
        "text_tokens": (torch.int64, shape),
        "modality": (torch.int64, shape),
        "positions": (torch.int64, shape),
        "doc_ids": (torch.int64, shape),
        "audio_frames": (torch.float32, (*shape, config.audio_dim)),
        "video_patches": (torch.float32, (*shape, config.video_dim)),
    }
    for key, (dtype, key_shape) in expected.items():
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != key_shape:
            got = (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value)
            raise ConfigError(f"batch[{key!r}] must be {dtype} of shape {key_shape}, got {got}")
    _check_range(batch["modality"], "modality", 0, len(Modality) - 1)
    _check_range(tokens, "text_tokens", 0, config.vocab_size - 1)
    _check_range(batch["positions"], "positions", 0, config.max_positions - 1)
    _check_range(batch["doc_ids"], "doc_ids", -1, shape[1])
    if not torch.equal(batch["doc_ids"] < 0, batch["modality"] == Modality.PAD):
        raise ConfigError("batch['doc_ids'] must be -1 exactly where batch['modality'] is 0 (padding)")


def _check_range(value: torch.Tensor, key: str, low: int, high: int) -> None:
    if value.numel() and not (int(value.min()) >= low and int(value.max()) <= high):
        raise ConfigError(
            f"batch[{key!r}] values must lie in [{low}, {high}], got [{int(value.min())}, {int(value.max())}]"
        )


def synthetic_batch(
    config: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    max_doc_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """A random batch that follows the contract: rows packed with documents of mixed modality.

    Each document is a run of segments (text, audio or video, 1-8 tokens each); video patches come in
    groups of 4 that share one temporal position, the way patches of one frame share a timestamp. Rows
    end with a little padding. Deterministic in ``seed``; for tests, benchmarks and the demo.
    """
    generator = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    max_doc_len = max_doc_len or max(4, seq_len // 2)
    modality = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    positions = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    doc_ids = torch.full((batch_size, seq_len), -1, dtype=torch.int64)
    for row in range(batch_size):
        used = seq_len - randint(0, max(1, seq_len // 8))  # leave some padding at the end
        start, doc = 0, 0
        while start < used:
            length = min(randint(2, max_doc_len), used - start)
            _fill_document(modality[row], positions[row], start, length, randint)
            doc_ids[row, start : start + length] = doc
            start, doc = start + length, doc + 1
    positions.clamp_(max=config.max_positions - 1)
    is_text = modality == Modality.TEXT
    return {
        "text_tokens": torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator) * is_text,
        "audio_frames": torch.randn(batch_size, seq_len, config.audio_dim, generator=generator)
        * (modality == Modality.AUDIO).unsqueeze(-1),
        "video_patches": torch.randn(batch_size, seq_len, config.video_dim, generator=generator)
        * (modality == Modality.VIDEO).unsqueeze(-1),
        "modality": modality,
        "positions": positions,
        "doc_ids": doc_ids,
    }


def _fill_document(modality: torch.Tensor, positions: torch.Tensor, start: int, length: int, randint) -> None:
    index, time = start, 0
    while index < start + length:
        kind = randint(1, 3)
        count = min(randint(1, 8), start + length - index)
        for k in range(count):
            modality[index], positions[index] = kind, time
            index += 1
            if kind != Modality.VIDEO or k % 4 == 3:
                time += 1
        if kind == Modality.VIDEO and count % 4:
            time += 1
