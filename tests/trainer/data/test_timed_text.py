"""Timed text in the token layout: a segment sits at the 40 ms position where it starts, after the
media of its 2-second chunk; untimed text leads the document (tokens.assemble)."""

from __future__ import annotations

import numpy as np
import pytest

from resilient.trainer.data import AUDIO, TEXT, VIDEO, DataConfig
from resilient.trainer.data.shard_source import clip_frames, cut_windows, segment_position
from resilient.trainer.data.tokens import TimedText, assemble

pytestmark = pytest.mark.timeout(30)


def _document(frames: int, timed: list[TimedText], lead: list[int]) -> tuple:
    config = DataConfig(video_fps=2, frame_size=16, patch_size=8)
    audio = np.arange(frames * config.audio_dim, dtype=np.float32).reshape(frames, config.audio_dim)
    video_frames = int(config.video_frames(np.asarray(frames)))
    video = np.ones((video_frames, config.patches_per_frame, config.video_dim), dtype=np.float32)
    sample = assemble(
        7,
        lead=np.asarray(lead, dtype=np.int64),
        audio=audio,
        video=video,
        timed=timed,
        tail=np.zeros(0, dtype=np.int64),
        span=frames,
        config=config,
    )
    return sample, config


def test_a_segment_sits_at_its_start_after_the_media_of_its_chunk() -> None:
    # 3 s of media: chunk 0 is positions 0..49, chunk 1 is 50..74. "hello" starts at 0.4 s
    # (position 10), "world" at 2.2 s (position 55).
    timed = [TimedText(10, np.asarray([101, 102])), TimedText(55, np.asarray([103]))]
    sample, _ = _document(75, timed, lead=[5, 6, 7])
    lead = 3
    assert sample.modality[:lead].tolist() == [TEXT] * 3 and sample.positions[:lead].tolist() == [0, 1, 2]
    text_slots = np.flatnonzero((sample.modality == TEXT) & (np.arange(len(sample)) >= lead))
    assert sample.text_tokens[text_slots].tolist() == [101, 102, 103]
    assert (sample.positions[text_slots] - lead).tolist() == [10, 10, 55]
    # Each segment comes after every media token of its own chunk and before the next chunk's.
    chunk = (sample.positions - lead) // 50
    for slot in text_slots:
        same = np.flatnonzero((chunk == chunk[slot]) & (sample.modality != TEXT))
        later = np.flatnonzero((chunk > chunk[slot]) & (sample.modality != TEXT))
        assert same.max() < slot and (len(later) == 0 or later.min() > slot)
    # The media themselves are laid out as for a synthetic clip: every audio position once.
    audio_positions = sample.positions[sample.modality == AUDIO] - lead
    assert audio_positions.tolist() == list(range(75))
    assert set((sample.positions[sample.modality == VIDEO] - lead).tolist()) == {0, 12, 25, 37, 50, 62}
    assert len(sample) == 3 + 3 + 75 + 6 * 4


def test_windows_cover_a_clip_and_segments_land_in_exactly_one() -> None:
    assert cut_windows(10.0, 200) == [(0, 200), (200, 50)]
    assert cut_windows(0.01, 200) == [(0, 1)]  # a clip shorter than one position still has one
    assert clip_frames(3.0) == 75
    total = clip_frames(10.0)
    for start_s in (0.0, 7.99, 8.0, 9.999, 12.0, -1.0):
        position = segment_position(start_s, total)
        owners = [w for w, (s, n) in enumerate(cut_windows(10.0, 200)) if s <= position < s + n]
        assert len(owners) == 1, (start_s, position)
    assert segment_position(12.0, total) == total - 1 and segment_position(-1.0, total) == 0
