"""config.py: ModelConfig validation, parameter and FLOP counts."""

from __future__ import annotations

import pytest

from resilient.errors import ConfigError
from resilient.trainer.model import ModelConfig, OmniModel, flops_per_token, parameter_counts


@pytest.mark.timeout(30)
def test_defaults_resolve_optional_fields() -> None:
    config = ModelConfig(dim=96, n_heads=6)
    assert config.n_kv_heads == 6
    assert config.ffn_hidden_dim == 256  # 8/3 * 96 = 256, already a multiple of 64
    assert config.head_dim == 16


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dim": 0}, r"ModelConfig.dim=0 must be an integer >= 1"),
        ({"dim": 30, "n_heads": 4}, r"dim=30 must be divisible by n_heads=4"),
        ({"dim": 12, "n_heads": 4}, r"must be even"),
        ({"n_heads": 4, "n_kv_heads": 3}, r"n_kv_heads=3 must divide n_heads=4"),
        ({"norm_eps": 0.0}, r"norm_eps=0.0 must be > 0"),
        ({"media_loss_weight": -0.1}, r"media_loss_weight=-0.1 must be >= 0"),
        ({"dtype": "float16"}, r"dtype='float16' must be one of \['bfloat16', 'float32'\]"),
        ({"n_layers": True}, r"n_layers=True must be an integer"),
    ],
)
def test_rejects_bad_values_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**fields)


@pytest.mark.timeout(30)
def test_parameter_counts_match_the_model_and_flops_follow_the_formula() -> None:
    config = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=50, audio_dim=6, video_dim=10)
    model = OmniModel(config)
    counts = parameter_counts(config)
    assert counts["embedding"] + counts["dense"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == model.tok_embeddings.weight.numel() + model.modality_embeddings.weight.numel()
    seq_len = 128
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    assert flops_per_token(config, seq_len) == 6 * counts["dense"] + attention
    with pytest.raises(ConfigError, match="seq_len=0"):
        flops_per_token(config, 0)
