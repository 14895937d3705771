from __future__ import annotations

import numpy as np
import pytest

from resilient.trainer.data import DataConfig, OmniSource, tokenize
from resilient.trainer.data.source import HIGH_HZ, LOW_HZ
from resilient.trainer.data.vocab import SIZES

from .decode import audio_times, frame_time


@pytest.mark.timeout(20)
def test_clip_is_a_pure_function_of_seed_and_index() -> None:
    a = OmniSource(DataConfig(seed=3, num_samples=10)).clip(5)
    b = OmniSource(DataConfig(seed=3, num_samples=5000)).clip(5)  # num_samples plays no part
    other = OmniSource(DataConfig(seed=4)).clip(5)
    assert a.params == b.params and a.caption == b.caption
    np.testing.assert_array_equal(a.audio, b.audio)
    np.testing.assert_array_equal(a.video, b.video)
    assert a.params != other.params


@pytest.mark.timeout(20)
def test_clip_shapes_ranges_and_caption() -> None:
    config = DataConfig()
    source = OmniSource(config)
    lengths = source.audio_frame_counts(np.arange(2000))
    assert lengths.min() == 25 and lengths.max() == 200  # 1 to 8 s, both ends reached
    for index in range(20):
        clip = source.clip(index)
        p = clip.params
        assert clip.audio.shape == (p.audio_frames * 640,) and clip.audio.dtype == np.float32
        frames = -(-p.audio_frames * 2 // 25)  # ceil: frames at 0, 0.5, 1.0 ... s inside the clip
        assert clip.video.shape == (frames, 16, 16, 3)
        pitch = p.pitch_hz(np.asarray([0.0, p.seconds]))
        assert pitch.min() >= LOW_HZ and pitch.max() <= HIGH_HZ
        assert clip.caption[1:3] == [p.size, p.color]
        assert clip.caption[5] == ("right" if p.rising else "left")
        assert len(tokenize(clip, config)) == source.token_counts(np.asarray([index]))[0]


@pytest.mark.timeout(20)
def test_content_encodes_time() -> None:
    """Pitch read back from the sound and position read back from the picture give the time."""
    config = DataConfig()
    source = OmniSource(config)
    for index in range(10):
        clip = source.clip(index)
        sample = tokenize(clip, config)
        heard = audio_times(sample.audio_frames, clip.params, config)
        # Audio frame m spans [40m, 40m + 40) ms: its pitch is read at the frame's middle.
        np.testing.assert_allclose(heard, np.arange(len(heard)) * 0.04 + 0.02, atol=0.2)
        side = SIZES[clip.params.size]
        seen = [frame_time(frame, clip.params, side, config.frame_size) for frame in clip.video]
        np.testing.assert_allclose(seen, np.arange(len(clip.video)) / config.video_fps, atol=1e-4)
