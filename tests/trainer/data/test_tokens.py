from __future__ import annotations

import numpy as np
import pytest

from resilient.trainer.data import AUDIO, TEXT, VIDEO, DataConfig, OmniSource, RowKey, RowStream, tokenize
from resilient.trainer.data.vocab import PROMPT_WORDS, SIZES, WORD_IDS

from .decode import audio_times, frame_time, patches_to_frame


def _runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal values."""
    edges = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(values)]])
    return [(int(values[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


@pytest.mark.timeout(20)
def test_sample_layout() -> None:
    """[prompt][video, audio of chunk 0][video, audio of chunk 1]...[caption], TMRoPE positions."""
    config = DataConfig()
    source = OmniSource(config)
    index = next(i for i in range(100) if source.params(i).audio_frames > 150)  # a 4-chunk clip
    clip = source.clip(index)
    sample = tokenize(clip, config)
    frames = clip.params.audio_frames
    kinds = [value for value, _, _ in _runs(sample.modality)]
    chunks = -(-frames // 50)
    assert kinds == [TEXT] + [VIDEO, AUDIO] * chunks + [TEXT]
    assert sample.text_tokens[: len(PROMPT_WORDS)].tolist() == [WORD_IDS[w] for w in PROMPT_WORDS]
    assert sample.text_tokens[-1] == WORD_IDS["<eos>"]
    assert (sample.text_tokens[sample.modality != TEXT] == 0).all()
    prompt = len(PROMPT_WORDS)
    audio_positions = sample.positions[sample.modality == AUDIO]
    np.testing.assert_array_equal(audio_positions, prompt + np.arange(frames))  # one per 40 ms
    video_positions = sample.positions[sample.modality == VIDEO].reshape(-1, 4)
    assert (video_positions == video_positions[:, :1]).all()  # a frame's patches share its time
    # 2 fps: frame j at j/2 s = position floor(12.5 j), the same as the audio frame of that instant.
    np.testing.assert_array_equal(video_positions[:, 0], prompt + (25 * np.arange(len(clip.video))) // 2)
    caption_positions = sample.positions[-len(clip.caption) :]
    np.testing.assert_array_equal(caption_positions, prompt + frames + np.arange(len(clip.caption)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fps", [2, 3])
def test_chunks_are_time_aligned_by_content(fps: int) -> None:
    """In packed rows, chunk k's audio and video tokens show instants inside [2k, 2k + 2) s.

    Times are read from content (pitch of the sound, position of the square), then compared with
    the chunk the token sits in and with its temporal position.
    """
    config = DataConfig(video_fps=fps)
    stream = RowStream(config)
    source = OmniSource(config)
    batch = stream.batch(stream.rows_for_step(RowKey(0, 0), 0, 1))
    checked = 0
    for b, ids in enumerate(batch["sample_ids"]):
        for doc, sid in enumerate(ids):
            params = source.params(int(sid.split(":")[1]))
            in_doc = (batch["doc_ids"][b] == doc).numpy()
            modality = batch["modality"][b].numpy()[in_doc]
            positions = batch["positions"][b].numpy()[in_doc]
            audio = batch["audio_frames"][b].numpy()[in_doc]
            video = batch["video_patches"][b].numpy()[in_doc]
            media = np.flatnonzero(modality != TEXT)
            origin = positions[media[0]]  # video frame 0, time 0
            runs = [run for run in _runs(modality) if run[0] != TEXT]
            for chunk in range(len(runs) // 2):
                (v_kind, v0, v1), (a_kind, a0, a1) = runs[2 * chunk], runs[2 * chunk + 1]
                assert (v_kind, a_kind) == (VIDEO, AUDIO)
                low, high = 2.0 * chunk, 2.0 * chunk + 2.0
                heard = audio_times(audio[a0:a1], params, config)
                assert (heard > low - 0.2).all() and (heard < high + 0.2).all()
                np.testing.assert_allclose(heard, (positions[a0:a1] - origin) * 0.04 + 0.02, atol=0.2)
                side = SIZES[params.size]
                for f0 in range(v0, v1, 4):
                    frame = patches_to_frame(video[f0 : f0 + 4], config.frame_size, config.patch_size)
                    seen = frame_time(frame, params, side, config.frame_size)
                    assert low - 1e-4 <= seen < high
                    assert positions[f0] - origin == int(np.floor(seen * 25 + 1e-3))
                    checked += 1
    assert checked > 100
