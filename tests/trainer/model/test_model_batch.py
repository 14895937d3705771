"""batch.py: the batch contract check and the synthetic batch generator."""

from __future__ import annotations

import pytest
import torch

from resilient.errors import ConfigError
from resilient.trainer.model import Modality, ModelConfig, synthetic_batch, validate_batch

CONFIG = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, audio_dim=6, video_dim=10, max_positions=64)


@pytest.mark.timeout(30)
def test_synthetic_batch_follows_the_contract_and_is_deterministic() -> None:
    batch = synthetic_batch(CONFIG, batch_size=3, seq_len=40, seed=5)
    validate_batch(batch, CONFIG)
    again = synthetic_batch(CONFIG, batch_size=3, seq_len=40, seed=5)
    assert all(torch.equal(batch[key], again[key]) for key in batch)
    modality = batch["modality"]
    assert {int(m) for m in modality.unique()} == {0, 1, 2, 3}
    assert torch.all(batch["audio_frames"][modality != Modality.AUDIO] == 0)
    assert torch.all(batch["text_tokens"][modality != Modality.TEXT] == 0)
    # Positions restart at 0 with every document.
    doc_ids = batch["doc_ids"]
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    assert torch.all(batch["positions"][starts & (doc_ids >= 0)] == 0)


@pytest.mark.timeout(30)
def test_validate_batch_names_the_bad_key() -> None:
    batch = synthetic_batch(CONFIG, batch_size=2, seq_len=16, seed=0)
    with pytest.raises(ConfigError, match="missing keys \\['doc_ids'\\]"):
        validate_batch({k: v for k, v in batch.items() if k != "doc_ids"}, CONFIG)
    with pytest.raises(ConfigError, match="audio_frames"):
        validate_batch({**batch, "audio_frames": torch.zeros(2, 16, 7)}, CONFIG)
    with pytest.raises(ConfigError, match="positions.*\\[0, 63\\]"):
        validate_batch({**batch, "positions": batch["positions"] + 64}, CONFIG)
    modality = batch["modality"].clone()
    modality[0, 0] = Modality.PAD  # padding inside a document
    with pytest.raises(ConfigError, match="doc_ids.*-1 exactly where"):
        validate_batch({**batch, "modality": modality}, CONFIG)
