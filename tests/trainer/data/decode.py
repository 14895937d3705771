"""Reading time back from token content (independent of positions) for the alignment tests."""

from __future__ import annotations

import numpy as np

from resilient.trainer.data import ClipParams, DataConfig
from resilient.trainer.data.source import HIGH_HZ, LOW_HZ
from resilient.trainer.data.tokens import AUDIO_LOG_SCALE


def audio_times(features: np.ndarray, params: ClipParams, config: DataConfig) -> np.ndarray:
    """Time of each audio token from its pitch: power-weighted centre of the loudest bands."""
    power = np.expm1(np.asarray(features, dtype=np.float64) * AUDIO_LOG_SCALE)
    band_hz = 8000.0 / config.audio_bands
    peak = power.argmax(axis=1)
    bands = np.clip(np.stack([peak - 1, peak, peak + 1], axis=1), 0, config.audio_bands - 1)
    weight = np.take_along_axis(power, bands, axis=1)
    hz = ((bands + 0.5) * band_hz * weight).sum(axis=1) / weight.sum(axis=1)
    return params.time_of_pitch(hz)


def frame_time(frame: np.ndarray, params: ClipParams, side: int, frame_size: int) -> float:
    """Time of a video frame from where the square is: its x follows the pitch."""
    columns = np.asarray(frame, dtype=np.float64).sum(axis=(0, 2))
    centre = float((columns * (np.arange(frame_size) + 0.5)).sum() / columns.sum())
    unit = (centre - side / 2 - 1.0) / (frame_size - 2 - side)
    return float(params.time_of_pitch(LOW_HZ + unit * (HIGH_HZ - LOW_HZ)))


def patches_to_frame(patches: np.ndarray, frame_size: int, patch: int) -> np.ndarray:
    """Inverse of tokens.video_patches for one frame: [patches, patch*patch*3] -> [H, W, 3]."""
    grid = frame_size // patch
    tiles = np.asarray(patches).reshape(grid, grid, patch, patch, 3)
    return tiles.transpose(0, 2, 1, 3, 4).reshape(frame_size, frame_size, 3)
