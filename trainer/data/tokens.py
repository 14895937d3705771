"""Tokenization of one clip on one time axis, after Qwen2.5-Omni's time-aligned positions (TMRoPE,
Qwen2.5-Omni technical report, arXiv:2503.20215).

Layout of a sample: ``[prompt text][chunk 0: video, audio][chunk 1: video, audio]...[caption]``.

- Audio: one token per 40 ms frame (640 samples). The token is a small spectral feature rather
  than the raw samples: ``audio_bands`` log band powers of the Hann-windowed frame's spectrum
  (linear bands over 0-8 kHz, 25 Hz rfft bins summed per band), ``log1p(power) / 10`` so values
  sit near [0, 1]. That keeps ``audio_dim`` small (64 by default, vs 640) and pitch readable.
- Video: each frame is cut into (frame_size / patch_size)^2 patches, one token each, values in
  (row, column, channel) order.
- Time: one temporal position per 40 ms. Audio frame m has position m; video frame j (shown at
  j / fps s) has position floor(25 j / fps), the 40 ms step it falls in, and all its patches share
  it. So video and audio of the same instant carry the same temporal position, as in TMRoPE.
- Interleaving: media is cut into 2-second chunks (50 positions); each chunk lists its video
  tokens, then its audio tokens, so a model reading left to right sees sight and sound of a moment
  together rather than all video before all audio.
- Text positions count one per token: the prompt takes 0..P-1, media positions are offset by P,
  and the caption continues from the largest media position + 1 (TMRoPE's rule for text after
  multimodal input). Positions restart at 0 in every document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resilient.trainer.data.config import AUDIO_FRAME_SAMPLES, CHUNK_FRAMES, FRAMES_PER_SECOND, DataConfig
from resilient.trainer.data.source import Clip
from resilient.trainer.data.vocab import PROMPT_WORDS, encode

PAD, TEXT, AUDIO, VIDEO = 0, 1, 2, 3
"""Modality ids per token."""
AUDIO_LOG_SCALE = 10.0
"""Divides log1p(band power): a full-scale tone's band lands near 1."""


@dataclass(frozen=True, slots=True)
class TokenizedSample:
    """One document's tokens; media features are stored densely with the token slots they fill."""

    index: int
    modality: np.ndarray
    """int64 [T]"""
    positions: np.ndarray
    """int64 [T], temporal positions starting at 0."""
    text_tokens: np.ndarray
    """int64 [T], token id at text slots, 0 elsewhere."""
    audio_slots: np.ndarray
    """int64 [Ta], the token indices holding audio, in order."""
    audio_frames: np.ndarray
    """float32 [Ta, audio_dim], features of the tokens at audio_slots."""
    video_slots: np.ndarray
    """int64 [Tv]"""
    video_patches: np.ndarray
    """float32 [Tv, video_dim]"""

    def __len__(self) -> int:
        return len(self.modality)


_HANN = np.hanning(AUDIO_FRAME_SAMPLES).astype(np.float32)


def audio_features(audio: np.ndarray, bands: int) -> np.ndarray:
    """[frames, bands] float32: log band powers of each 40 ms frame."""
    frames = audio.reshape(-1, AUDIO_FRAME_SAMPLES) * _HANN
    spectrum = np.fft.rfft(frames, axis=-1)[:, : AUDIO_FRAME_SAMPLES // 2]
    power = spectrum.real**2 + spectrum.imag**2
    banded = power.reshape(len(frames), bands, -1).sum(axis=-1)
    return (np.log1p(banded) / AUDIO_LOG_SCALE).astype(np.float32)


def video_patches(video: np.ndarray, patch: int) -> np.ndarray:
    """[frames, patches_per_frame, patch * patch * 3]: row-major grid of patches per frame."""
    frames, height, width, channels = video.shape
    grid = video.reshape(frames, height // patch, patch, width // patch, patch, channels)
    return grid.transpose(0, 1, 3, 2, 4, 5).reshape(frames, -1, patch * patch * channels)


@dataclass(frozen=True, slots=True)
class TimedText:
    """Text tokens said or shown at one instant: they sit in the stream at that time."""

    position: int
    """Temporal position (40 ms steps from the media's start) every token of it takes."""
    ids: np.ndarray
    """int64 token ids."""


_VIDEO_KIND, _AUDIO_KIND, _TEXT_KIND = 0, 1, 2
"""Order within a 2-second chunk: what is seen, what is heard, then what is said of it."""


def _media_order(
    audio_frames: int, video_frames: int, timed: list[TimedText], config: DataConfig
) -> tuple[np.ndarray, ...]:
    """Token order of the media and timed text: (kind, item, temporal position), each [Ta + Tv + Tt].

    item is the audio frame index for audio, frame * patches_per_frame + patch for video, and the
    token's index in the concatenated timed texts for text.
    """
    per_frame = config.patches_per_frame
    video_item = np.arange(video_frames * per_frame)
    video_time = (FRAMES_PER_SECOND * (video_item // per_frame)) // config.video_fps
    text_time = np.concatenate([np.full(len(t.ids), t.position) for t in timed] or [np.zeros(0, np.int64)])
    kind = np.concatenate(
        [
            np.full(len(video_item), _VIDEO_KIND),
            np.full(audio_frames, _AUDIO_KIND),
            np.full(len(text_time), _TEXT_KIND),
        ]
    ).astype(np.int64)
    item = np.concatenate([video_item, np.arange(audio_frames), np.arange(len(text_time))])
    time = np.concatenate([video_time, np.arange(audio_frames), text_time]).astype(np.int64)
    # Sort by chunk, then kind, then item (frames, patches and words keep their order).
    order = np.lexsort((item, kind, time // CHUNK_FRAMES))
    return kind[order], item[order], time[order]


def assemble(
    index: int,
    *,
    lead: np.ndarray,
    audio: np.ndarray,
    video: np.ndarray,
    timed: list[TimedText],
    tail: np.ndarray,
    span: int,
    config: DataConfig,
) -> TokenizedSample:
    """One document: ``lead`` text, the media interleaved by 2-second chunk with the timed text,
    then ``tail`` text. ``audio`` [Ta, audio_dim] (one row per 40 ms position), ``video``
    [frames, patches_per_frame, video_dim]; ``span``: the media's length in 40 ms positions (the
    tail continues after it)."""
    kind, item, time = _media_order(len(audio), len(video), timed, config)
    media_start = len(lead)
    tail_start = media_start + len(kind)
    modality = np.concatenate(
        [np.full(len(lead), TEXT), np.array([VIDEO, AUDIO, TEXT])[kind], np.full(len(tail), TEXT)]
    ).astype(np.int64)
    positions = np.concatenate([np.arange(len(lead)), media_start + time, media_start + span + np.arange(len(tail))])
    text_tokens = np.zeros(len(modality), dtype=np.int64)
    text_tokens[: len(lead)] = lead
    text_tokens[tail_start:] = tail
    media_slots = media_start + np.arange(len(kind))
    is_text = kind == _TEXT_KIND
    if is_text.any():
        text_tokens[media_slots[is_text]] = np.concatenate([t.ids for t in timed])[item[is_text]]
    is_audio, is_video = kind == _AUDIO_KIND, kind == _VIDEO_KIND
    return TokenizedSample(
        index=index,
        modality=modality,
        positions=positions.astype(np.int64),
        text_tokens=text_tokens,
        audio_slots=media_slots[is_audio],
        audio_frames=audio[item[is_audio]],
        video_slots=media_slots[is_video],
        video_patches=video.reshape(-1, config.video_dim)[item[is_video]],
    )


def tokenize(clip: Clip, config: DataConfig) -> TokenizedSample:
    """The tokens of one synthetic clip: prompt, media, caption (see the module docstring)."""
    audio = audio_features(clip.audio, config.audio_bands)
    return assemble(
        clip.params.index,
        lead=np.asarray(encode(PROMPT_WORDS), dtype=np.int64),
        audio=audio,
        video=video_patches(clip.video, config.patch_size),
        timed=[],
        tail=np.asarray(encode(clip.caption), dtype=np.int64),
        span=len(audio),
        config=config,
    )
