"""A deterministic synthetic omni source: sample i of seed s is a short clip with sound, picture
and a caption, all three telling the same story on one time axis.

Each clip is a chirp (a tone whose pitch moves linearly in time) pulsed by a beat envelope, and a
square whose horizontal position follows the pitch and which hops up on every beat. Because pitch
is a known linear function of time, a test can read the time of any audio or video token from its
content alone and check that the tokenizer put it in the right 2-second chunk.

Everything is a pure function of (seed, index) via counter-based hashing, so it does not depend on
the epoch, the order of rendering, the worker, or num_samples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from resilient.trainer.data import hashing
from resilient.trainer.data.config import FRAMES_PER_SECOND, SAMPLE_RATE, DataConfig
from resilient.trainer.data.vocab import COLORS, SIZES, TEMPOS, caption_words

LOW_HZ = 200.0
"""Lowest pitch any clip reaches; maps to the object's leftmost position."""
HIGH_HZ = 4000.0
"""Highest pitch any clip reaches (well under the 8 kHz Nyquist limit); the rightmost position."""
_ENVELOPE_FLOOR = 0.2
"""Loudness between beats: the tone never goes silent, so every audio frame has a pitch."""
_DECAY_BEATS = 0.25
"""Beat envelope decay time, as a fraction of the beat period."""

# One hash stream per independent choice, so adding a choice never shifts the others.
_FRAMES, _RISING, _START, _RATE, _COLOR, _SIZE, _TEMPO = range(1, 8)
_COLOR_NAMES, _SIZE_NAMES, _TEMPO_NAMES = tuple(COLORS), tuple(SIZES), tuple(TEMPOS)


@dataclass(frozen=True, slots=True)
class ClipParams:
    """Everything that defines one clip."""

    index: int
    audio_frames: int
    """Clip length in 40 ms frames."""
    rising: bool
    start_hz: float
    rate_hz_per_s: float
    """Pitch speed (positive); the pitch rises or falls at this rate."""
    color: str
    size: str
    tempo: str

    @property
    def seconds(self) -> float:
        return self.audio_frames / FRAMES_PER_SECOND

    def pitch_hz(self, t: np.ndarray) -> np.ndarray:
        """Tone frequency at times t (seconds); stays within [LOW_HZ, HIGH_HZ]."""
        sign = 1.0 if self.rising else -1.0
        return self.start_hz + sign * self.rate_hz_per_s * t

    def time_of_pitch(self, hz: np.ndarray) -> np.ndarray:
        """Inverse of pitch_hz: the time at which the tone has this frequency."""
        sign = 1.0 if self.rising else -1.0
        return (hz - self.start_hz) / (sign * self.rate_hz_per_s)

    def beat(self, t: np.ndarray) -> np.ndarray:
        """1 at each beat onset, decaying exponentially until the next one."""
        period = 1.0 / TEMPOS[self.tempo]
        return np.exp(-np.mod(t, period) / (_DECAY_BEATS * period))


@dataclass(frozen=True, slots=True)
class Clip:
    params: ClipParams
    audio: np.ndarray
    """float32 [audio_frames * 640] at 16 kHz, in [-0.5, 0.5]."""
    video: np.ndarray
    """float32 [video_frames, frame_size, frame_size, 3] RGB in [0, 1]; frame j is at j / fps s."""
    caption: list[str]


@functools.cache
def _loudness_period(tempo: str) -> np.ndarray:
    """Amplitude over one beat at 16 kHz (tempos divide 16000, so it tiles exactly).

    A lookup table instead of exp(mod(t, period)) per sample: same values, a fraction of the cost.
    """
    period = np.arange(round(SAMPLE_RATE / TEMPOS[tempo])) / SAMPLE_RATE
    beat = np.exp(-period / (_DECAY_BEATS / TEMPOS[tempo]))
    return (0.5 * (_ENVELOPE_FLOOR + (1.0 - _ENVELOPE_FLOOR) * beat)).astype(np.float32)


def object_left(params: ClipParams, t: np.ndarray, frame_size: int) -> np.ndarray:
    """The square's left edge (pixels, fractional) at times t: a linear map of the pitch."""
    side = SIZES[params.size]
    unit = (params.pitch_hz(t) - LOW_HZ) / (HIGH_HZ - LOW_HZ)
    return 1.0 + (frame_size - 2 - side) * unit


def object_top(params: ClipParams, t: np.ndarray, frame_size: int) -> np.ndarray:
    """The square's top edge: at the top on each beat onset, falling back as the note decays."""
    side = SIZES[params.size]
    return 1.0 + (frame_size - 2 - side) * (1.0 - params.beat(t))


def _coverage(start: np.ndarray, side: int, size: int) -> np.ndarray:
    """[n, size]: how much of each pixel an interval [start, start + side) covers.

    Fractional coverage (anti-aliasing) keeps sub-pixel motion visible in a 16-pixel frame, and
    with an integer side the coverage-weighted centroid is exactly start + side / 2.
    """
    pixel = np.arange(size, dtype=np.float64)[None, :]
    start = start[:, None]
    return np.clip(np.minimum(pixel + 1.0, start + side) - np.maximum(pixel, start), 0.0, 1.0)


class OmniSource:
    """Renders clip i of the configured seed; cheap per-index sizing for the packer."""

    def __init__(self, config: DataConfig) -> None:
        self._config = config

    def audio_frame_counts(self, indices: np.ndarray) -> np.ndarray:
        """Clip lengths in 40 ms frames, vectorized (no rendering)."""
        cfg = self._config
        return hashing.integers(cfg.min_audio_frames, cfg.max_audio_frames, cfg.seed, _FRAMES, indices)

    def token_counts(self, indices: np.ndarray) -> np.ndarray:
        """Tokens of each sample, vectorized (no rendering)."""
        return self._config.sample_tokens(self.audio_frame_counts(indices))

    def params(self, index: int) -> ClipParams:
        cfg = self._config
        seed = cfg.seed
        # The sweep over the longest clip spans at most 90% of [LOW_HZ, HIGH_HZ], so every clip's
        # pitch (and so the object) stays inside the range whatever its start.
        max_sweep = 0.9 * (HIGH_HZ - LOW_HZ)
        rate = (0.75 + 0.25 * hashing.uniform(seed, _RATE, index)[0]) * max_sweep / cfg.max_clip_seconds
        slack = (HIGH_HZ - LOW_HZ) - rate * cfg.max_clip_seconds
        offset = float(hashing.uniform(seed, _START, index)[0]) * slack
        rising = bool(hashing.uniform(seed, _RISING, index)[0] < 0.5)
        return ClipParams(
            index=index,
            audio_frames=int(self.audio_frame_counts(np.asarray([index]))[0]),
            rising=rising,
            start_hz=float(LOW_HZ + offset if rising else HIGH_HZ - offset),
            rate_hz_per_s=float(rate),
            color=_COLOR_NAMES[int(hashing.integers(0, len(_COLOR_NAMES) - 1, seed, _COLOR, index)[0])],
            size=_SIZE_NAMES[int(hashing.integers(0, len(_SIZE_NAMES) - 1, seed, _SIZE, index)[0])],
            tempo=_TEMPO_NAMES[int(hashing.integers(0, len(_TEMPO_NAMES) - 1, seed, _TEMPO, index)[0])],
        )

    def clip(self, index: int) -> Clip:
        params = self.params(index)
        caption = caption_words(
            size=params.size,
            color=params.color,
            rising=params.rising,
            tempo=params.tempo,
            seconds=params.seconds,
        )
        return Clip(params=params, audio=self._audio(params), video=self._video(params), caption=caption)

    def _audio(self, params: ClipParams) -> np.ndarray:
        t = np.arange(params.audio_frames * SAMPLE_RATE // FRAMES_PER_SECOND, dtype=np.float64)
        t *= 1.0 / SAMPLE_RATE
        sign = 1.0 if params.rising else -1.0
        # Phase is the integral of the instantaneous frequency start + sign * rate * t. Audio
        # synthesis dominates the cost of a row, so: in place, and the sine in float32 (15x faster
        # than float64) after wrapping the phase to [-pi, pi] in float64, so no precision is lost.
        phase = np.pi * sign * params.rate_hz_per_s * t
        phase += 2.0 * np.pi * params.start_hz
        phase *= t
        phase -= (2.0 * np.pi) * np.round(phase * (0.5 / np.pi))
        wave = np.sin(phase.astype(np.float32))
        wave *= np.resize(_loudness_period(params.tempo), len(wave))
        return wave

    def _video(self, params: ClipParams) -> np.ndarray:
        cfg = self._config
        frames = int(cfg.video_frames(np.asarray(params.audio_frames)))
        t = np.arange(frames) / cfg.video_fps
        side = SIZES[params.size]
        across = _coverage(object_left(params, t, cfg.frame_size), side, cfg.frame_size)
        down = _coverage(object_top(params, t, cfg.frame_size), side, cfg.frame_size)
        alpha = down[:, :, None] * across[:, None, :]
        color = np.asarray(COLORS[params.color], dtype=np.float64)
        return (alpha[..., None] * color).astype(np.float32)
