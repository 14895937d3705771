"""Configuration of the omni data pipeline, validated when built.

Fixed by the token scheme (not configurable, versioned through ``DATA_STATE_VERSION``): audio is
16 kHz and cut into 40 ms frames of 640 samples, one audio token per frame, so one temporal
position step is 40 ms (Qwen2.5-Omni's TMRoPE time unit) and a 2-second interleaving chunk holds 50
audio tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from resilient.errors import ConfigError
from resilient.trainer.data.vocab import TEXT_TOKENS_PER_SAMPLE, VOCAB
from resilient.validate import check_choice, check_int, check_number

SAMPLE_RATE = 16_000
"""Audio samples per second."""
AUDIO_FRAME_SAMPLES = 640
"""Raw samples behind one audio token: 40 ms at 16 kHz."""
FRAMES_PER_SECOND = 25
"""Audio tokens (and temporal positions) per second: one per 40 ms."""
CHUNK_FRAMES = 50
"""Temporal positions per interleaving chunk: 2 seconds."""
SOURCES = ("synthetic", "shards")
SPECTRUM_BINS = AUDIO_FRAME_SAMPLES // 2
"""rfft bins of one frame kept for the audio feature (the Nyquist bin is dropped): 25 Hz each."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Settings of the synthetic omni source, the tokenizer, the packer and the loader.

    Every field except ``global_rows``, ``num_workers``, ``prefetch_factor`` and
    ``worker_timeout_s`` changes the row stream and is hashed into the data-state fingerprint.
    """

    source: str = "synthetic"
    """Where samples come from: "synthetic" (the generator of source.py) or "shards" (real media
    built by ``resilient-data build``, read from ``shards``)."""
    shards: str = ""
    """The build's DEST (a folder or s3://bucket/prefix) when source is "shards"."""
    shards_fingerprint: str = ""
    """The build's fingerprint (manifest.json); filled in when the config is loaded. Set it to pin
    a run to one build: another build at the same place is then refused."""
    cache_dir: str = ""
    """Where members read from an S3 build are cached on this node ("": the system temp folder)."""
    cache_bytes: int = 2 * 1024**3
    """The cache's budget, least recently used evicted first; 0: no cache; [0, 2**50]."""
    seed: int = 0
    """Seeds sample content and the per-epoch order; [0, 2**63)."""
    row_len: int = 512
    """Tokens per packed row; [64, 2**20]."""
    global_rows: int = 8
    """Rows in one global batch (all data-parallel shares together); [1, 65536]."""
    num_samples: int = 1024
    """Synthetic samples per epoch: sample ids are 0 .. num_samples-1; [1, 2**31). (Shards: every
    window of every sample of the build, once per epoch.)"""
    packing_window: int = 64
    """Samples (consecutive in the epoch's permutation) that first-fit packs together; [1, 2**20]."""
    min_clip_seconds: float = 1.0
    """Shortest clip; clip lengths are uniform in [min, max], rounded to 40 ms; [0.04, 60]."""
    max_clip_seconds: float = 8.0
    """Longest clip; [min_clip_seconds, 60]. Real media longer than this is cut into windows of at
    most this length, each a document of its own."""
    video_fps: int = 2
    """Video frames per second; [1, 25] (at most one frame per 40 ms position)."""
    frame_size: int = 16
    """Video frames are frame_size x frame_size RGB; [4, 256], a multiple of patch_size."""
    patch_size: int = 8
    """Square patch side; a video token is one patch of patch_size*patch_size*3 values; [1, 64]."""
    audio_bands: int = 64
    """Log band powers per 40 ms audio token (= audio_dim); a divisor of 320 in [8, 320]."""
    vocab_size: int = 64
    """Text embedding rows; [number of caption words, 2**20]. Id 0 is padding."""
    num_workers: int = 2
    """DataLoader worker processes; 0 builds rows in the calling thread; [0, 64]."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (ignored when num_workers is 0); [1, 64]."""
    worker_timeout_s: float = 120.0
    """Longest wait for one batch from a worker before the loader raises; [1, 86400]."""

    def __post_init__(self) -> None:
        check_choice("data.source", self.source, SOURCES)
        if self.source == "shards" and (not isinstance(self.shards, str) or not self.shards):
            raise ConfigError(
                'data.source="shards" needs data.shards: the DEST of `resilient-data build SRC --out DEST`'
            )
        if not isinstance(self.cache_dir, str):
            raise ConfigError(f"data.cache_dir={self.cache_dir!r} must be a path string")
        check_int("data.cache_bytes", self.cache_bytes, 0, 2**50)
        check_int("DataConfig.seed", self.seed, 0, 2**63 - 1)
        check_int("DataConfig.row_len", self.row_len, 64, 2**20)
        check_int("DataConfig.global_rows", self.global_rows, 1, 65536)
        check_int("DataConfig.num_samples", self.num_samples, 1, 2**31 - 1)
        check_int("DataConfig.packing_window", self.packing_window, 1, 2**20)
        check_number("DataConfig.min_clip_seconds", self.min_clip_seconds, 0.04, 60.0)
        check_number("DataConfig.max_clip_seconds", self.max_clip_seconds, self.min_clip_seconds, 60.0)
        check_int("DataConfig.video_fps", self.video_fps, 1, FRAMES_PER_SECOND)
        check_int("DataConfig.patch_size", self.patch_size, 1, 64)
        check_int("DataConfig.frame_size", self.frame_size, 4, 256)
        if self.frame_size % self.patch_size:
            raise ConfigError(
                f"DataConfig.frame_size={self.frame_size} must be a multiple of "
                f"patch_size={self.patch_size}: pick e.g. frame_size={self.patch_size * 2}"
            )
        check_int("DataConfig.audio_bands", self.audio_bands, 8, SPECTRUM_BINS)
        if SPECTRUM_BINS % self.audio_bands:
            divisors = [d for d in range(8, SPECTRUM_BINS + 1) if SPECTRUM_BINS % d == 0]
            raise ConfigError(f"DataConfig.audio_bands={self.audio_bands} must divide 320: one of {divisors}")
        check_int("DataConfig.vocab_size", self.vocab_size, len(VOCAB), 2**20)
        check_int("DataConfig.num_workers", self.num_workers, 0, 64)
        check_int("DataConfig.prefetch_factor", self.prefetch_factor, 1, 64)
        check_number("DataConfig.worker_timeout_s", self.worker_timeout_s, 1.0, 86400.0)
        if self.min_audio_frames > self.max_audio_frames:
            raise ConfigError(
                f"DataConfig clip range [{self.min_clip_seconds}, {self.max_clip_seconds}] s holds no "
                "whole 40 ms frame: widen it to span a multiple of 0.04 s"
            )

    @property
    def audio_dim(self) -> int:
        """Features per audio token."""
        return self.audio_bands

    @property
    def video_dim(self) -> int:
        """Values per video token: one RGB patch."""
        return self.patch_size * self.patch_size * 3

    @property
    def patches_per_frame(self) -> int:
        """Video tokens per frame."""
        return (self.frame_size // self.patch_size) ** 2

    @property
    def min_audio_frames(self) -> int:
        """Audio tokens of the shortest clip."""
        return math.ceil(round(self.min_clip_seconds * FRAMES_PER_SECOND, 6))

    @property
    def max_audio_frames(self) -> int:
        """Audio tokens of the longest clip."""
        return math.floor(round(self.max_clip_seconds * FRAMES_PER_SECOND, 6))

    @property
    def max_sample_tokens(self) -> int:
        """Tokens of the longest possible sample; longer than row_len means truncation."""
        return int(self.sample_tokens(np.asarray(self.max_audio_frames)))

    @property
    def max_positions(self) -> int:
        """Largest temporal position + 1 in any batch (prompt + one per 40 ms + caption), for RoPE.
        Real media: untimed text (at most a row of it) + one per 40 ms."""
        lead = self.row_len if self.source == "shards" else TEXT_TOKENS_PER_SAMPLE
        return lead + self.max_audio_frames

    def video_frames(self, audio_frames: np.ndarray) -> np.ndarray:
        """Video frames of clips with these audio frame counts.

        Frame j is shown at j / video_fps seconds and kept while that instant lies inside the clip
        (25 j < audio_frames * fps, integer arithmetic so no frame is lost to rounding).
        """
        return (audio_frames * self.video_fps + FRAMES_PER_SECOND - 1) // FRAMES_PER_SECOND

    def sample_tokens(self, audio_frames: np.ndarray) -> np.ndarray:
        """Tokens of samples with these audio frame counts (text + video patches + audio frames)."""
        return TEXT_TOKENS_PER_SAMPLE + audio_frames + self.video_frames(audio_frames) * self.patches_per_frame
