from __future__ import annotations

import pytest

from resilient.errors import ConfigError
from resilient.trainer.data import DataConfig
from resilient.trainer.data.vocab import VOCAB


@pytest.mark.timeout(10)
def test_defaults_and_sizes() -> None:
    config = DataConfig()
    assert (config.audio_dim, config.video_dim, config.vocab_size) == (64, 192, 64)
    assert config.patches_per_frame == 4
    assert (config.min_audio_frames, config.max_audio_frames) == (25, 200)
    # 19 text + 200 audio + 16 frames x 4 patches: fits a 512-token row, so nothing is truncated.
    assert config.max_sample_tokens == 283
    assert len(VOCAB) <= config.vocab_size


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"row_len": 10}, "row_len"),
        ({"seed": -1}, "seed"),
        ({"global_rows": 0}, "global_rows"),
        ({"num_samples": True}, "num_samples"),
        ({"min_clip_seconds": 3.0, "max_clip_seconds": 2.0}, "max_clip_seconds"),
        ({"max_clip_seconds": float("nan")}, "max_clip_seconds"),
        ({"video_fps": 30}, "video_fps"),
        ({"frame_size": 12}, "frame_size"),
        ({"audio_bands": 50}, "audio_bands"),
        ({"vocab_size": 10}, "vocab_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"min_clip_seconds": 1.01, "max_clip_seconds": 1.02}, "clip range"),
    ],
)
def test_bad_values_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DataConfig(**overrides)
