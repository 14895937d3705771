"""Real media as the row stream's source: the samples of a ``resilient-data build`` (docs/shards.md),
cut into windows and tokenized on the same time axis as the synthetic clips.

An ITEM of the stream is one window of one sample: a clip longer than ``max_clip_seconds`` is cut
into consecutive windows of at most that length, each a document of its own (``<key>#<window>``).
How many tokens each item has follows from the shard indexes alone (durations and text token
counts), so the packing of an epoch is planned without reading a tar; the media are read and
decoded only when a row is built, in the loader's workers.

Per window, in the layout of tokens.py: the untimed text leads the sample's first window; audio is
one token per 40 ms; video frames at ``video_fps``; each timed text segment sits at the 40 ms
position of its start, after the media of its 2-second chunk. A window that does not decode raises
``SampleError``: the row stream leaves its slot empty and reports it, on every rank and every
resume alike (the same bytes fail the same way). A shard that cannot be READ is not skipped: that
error is transient or operational and stops the step (``ShardSet.read_member`` retries first).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from resilient.errors import ConfigError, IntegrityError, ResilientError
from resilient.storage.url import parse_url
from resilient.trainer.data.config import FRAMES_PER_SECOND, DataConfig
from resilient.trainer.data.tokens import TimedText, TokenizedSample, assemble, audio_features, video_patches

if TYPE_CHECKING:
    from resilient.trainer.data.shards.format import ShardSet

CACHE_FOLDER = "resilient-shard-cache"
"""Under the system temp folder when ``data.cache_dir`` is unset."""
READ_AHEAD = 8
"""Member reads in flight while a batch is built (``ShardSource.read_ahead``)."""


class SampleError(ResilientError):
    """One item of the stream cannot be built (its media do not decode, or its text disagrees
    with the index): skipped, deterministically."""


@dataclass(frozen=True, slots=True)
class Window:
    sample: int
    """Index into ``ShardSet.samples``."""
    number: int
    """Window of the sample (0 first)."""
    count: int
    """Windows the sample has: names carry ``#<number>`` only when it is cut."""
    start: int
    """First 40 ms position of the window within the sample."""
    frames: int
    """40 ms positions the window spans (>= 1)."""


def clip_frames(duration_s: float) -> int:
    """40 ms positions of a clip (at least one)."""
    return max(1, round(duration_s * FRAMES_PER_SECOND))


def cut_windows(duration_s: float, window_frames: int) -> list[tuple[int, int]]:
    """(start, frames) of the consecutive windows covering a clip of ``duration_s`` seconds."""
    total = clip_frames(duration_s)
    return [(start, min(window_frames, total - start)) for start in range(0, total, window_frames)]


def segment_position(start_s: float, total_frames: int) -> int:
    """The 40 ms position a timed segment sits at: where it starts, inside the clip."""
    return min(max(math.floor(start_s * FRAMES_PER_SECOND), 0), total_frames - 1)


_opened: dict[str, ShardSet] = {}
"""Builds this process opened, by DEST: the config load and the row stream read the manifest and
every index once, not twice (thousands of GETs for a large build on S3)."""


def open_build(dest: str) -> ShardSet:
    from resilient.trainer.data.shards.format import ShardSet  # deferred: opens storage

    if dest not in _opened:
        _opened[dest] = ShardSet.open(dest)
    return _opened[dest]


def resolve_build(config: DataConfig, *, vocab_given: bool) -> DataConfig:
    """``config`` with the build's fingerprint and vocabulary filled in (the model's vocab_size
    follows from it), after checking the recipe agrees with the build."""
    try:  # open_build's own errors name the build; a malformed URL's names only its text
        parse_url(config.shards)
    except ConfigError as e:
        raise ConfigError(f"data.shards: {e}") from e
    build = open_build(config.shards)
    if config.shards_fingerprint and config.shards_fingerprint != build.fingerprint:
        raise ConfigError(
            f"data.shards_fingerprint={config.shards_fingerprint!r} but the build at {config.shards} has "
            f"{build.fingerprint!r}: point data.shards at the pinned build, or unset data.shards_fingerprint"
        )
    if vocab_given and config.vocab_size < build.vocab_size:
        raise ConfigError(
            f"data.vocab_size={config.vocab_size} is smaller than the build's tokenizer ({build.vocab_size} ids, "
            f"{config.shards}/tokenizer.json): unset data.vocab_size to take it from the build"
        )
    vocab = config.vocab_size if vocab_given else build.vocab_size
    return dataclasses.replace(config, shards_fingerprint=build.fingerprint, vocab_size=vocab)


class ShardSource:
    """The items (sample windows) of a shard build, sized from its indexes, built on demand."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self.shards = open_build(config.shards)
        if config.shards_fingerprint and self.shards.fingerprint != config.shards_fingerprint:
            raise IntegrityError(
                f"the shard build at {config.shards} changed after the config was loaded (fingerprint "
                f"{self.shards.fingerprint}, config {config.shards_fingerprint}): a build was rewritten under a "
                "running job; restart it, or pin data.shards_fingerprint"
            )
        self.shards.use_cache(config.cache_dir or os.path.join(tempfile.gettempdir(), CACHE_FOLDER), config.cache_bytes)
        self._loaded_tokenizer = None
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[tuple[int, str], bytes] = {}
        self.windows: list[Window] = []
        counts = []
        for index, entry in enumerate(self.shards.samples):
            cut = cut_windows(entry.duration_s, config.max_audio_frames)
            for number, (start, frames) in enumerate(cut):
                self.windows.append(Window(index, number, len(cut), start, frames))
                counts.append(self._planned_tokens(entry, number, start, frames))
        self._token_counts = np.asarray(counts, dtype=np.int64)

    @property
    def num_items(self) -> int:
        return len(self.windows)

    def token_counts(self, indices: np.ndarray) -> np.ndarray:
        return self._token_counts[indices]

    def name(self, index: int) -> str:
        """The item's key in ``samples.jsonl``: the sample key, plus ``#<window>`` when cut."""
        window = self.windows[index]
        key = self.shards.samples[window.sample].key
        return f"{key}#{window.number}" if window.count > 1 else key

    def _planned_tokens(self, entry, number: int, start: int, frames: int) -> int:
        cfg = self.config
        total = clip_frames(entry.duration_s)
        text = entry.lead_tokens if number == 0 else 0
        text += sum(n for s, _, n in entry.segments if start <= segment_position(s, total) < start + frames)
        audio = frames if entry.audio else 0
        video = int(cfg.video_frames(np.asarray(frames))) * cfg.patches_per_frame if entry.video else 0
        return text + audio + video

    # -- building one item ---------------------------------------------------------------------

    def sample(self, index: int) -> TokenizedSample:
        """The tokens of item ``index``; SampleError if its media or text do not check out."""
        from resilient.trainer.data import media  # deferred: PyAV is loaded in the workers only

        window = self.windows[index]
        entry = self.shards.samples[window.sample]
        try:
            lead, timed = self._text(entry, window)
            blobs = {ext: self._member(window.sample, ext) for ext in {entry.audio, entry.video} - {None}}
            audio = self._audio(media, entry, blobs, window)
            video = self._video(media, entry, blobs, window)
        except media.MediaError as e:
            raise SampleError(f"{self.name(index)}: {e}") from e
        sample = assemble(
            index,
            lead=lead,
            audio=audio,
            video=video,
            timed=timed,
            tail=_NO_TOKENS,
            span=window.frames,
            config=self.config,
        )
        if len(sample) != self._token_counts[index]:
            raise SampleError(
                f"{self.name(index)}: {len(sample)} tokens, the shard index planned {self._token_counts[index]} "
                "(was tokenizer.json or the index edited after the build?)"
            )
        return sample

    def _text(self, entry, window: Window) -> tuple[np.ndarray, list[TimedText]]:
        try:
            text = self.shards.text(entry)
            lead_text = text.get("text", "") if window.number == 0 else ""
            segments = [(float(s["start"]), str(s["text"])) for s in text.get("segments", [])]
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # a damaged json member: this sample only
            raise SampleError(f"{entry.key}: unreadable text member ({type(e).__name__}: {e})") from e
        lead = _encode(self._tokenizer(), str(lead_text))
        total = clip_frames(entry.duration_s)
        timed = []
        for start_s, words in segments:
            position = segment_position(start_s, total)
            if window.start <= position < window.start + window.frames:
                timed.append(TimedText(position - window.start, _encode(self._tokenizer(), words)))
        return lead, timed

    def _audio(self, media, entry, blobs: dict[str, bytes], window: Window) -> np.ndarray:
        if not entry.audio:
            return np.zeros((0, self.config.audio_dim), dtype=np.float32)
        pcm = media.decode_audio(
            blobs[entry.audio],
            entry.audio,
            start_s=window.start / FRAMES_PER_SECOND,
            duration_s=window.frames / FRAMES_PER_SECOND,
        )
        return audio_features(pcm, self.config.audio_bands)

    def _video(self, media, entry, blobs: dict[str, bytes], window: Window) -> np.ndarray:
        cfg = self.config
        if not entry.video:
            return np.zeros((0, cfg.patches_per_frame, cfg.video_dim), dtype=np.float32)
        frames = media.decode_video(
            blobs[entry.video],
            entry.video,
            fps=cfg.video_fps,
            size=cfg.frame_size,
            start_s=window.start / FRAMES_PER_SECOND,
            duration_s=window.frames / FRAMES_PER_SECOND,
        )
        wanted = int(cfg.video_frames(np.asarray(window.frames)))
        if len(frames) == 0:
            raise media.MediaError(f"no video frame in [{window.start / FRAMES_PER_SECOND}, +{window.frames} x 40 ms)")
        if len(frames) < wanted:  # the video stream ends before the audio: hold its last frame
            frames = np.concatenate([frames, np.repeat(frames[-1:], wanted - len(frames), axis=0)])
        return video_patches(frames[:wanted], cfg.patch_size)

    def read_ahead(self, indices: list[int]) -> None:
        """Fetch the media of these items at once, READ_AHEAD requests in flight (a batch's worth:
        on S3 each member is a ranged GET, and a row's dozen of them one after the other would cost
        a dozen round trips). Held until ``sample`` takes them; replaces what an earlier call left."""
        wanted = {
            (w.sample, ext)
            for w in (self.windows[i] for i in indices)
            for ext in {self.shards.samples[w.sample].audio, self.shards.samples[w.sample].video} - {None}
        }
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="shard-read")
        ordered = sorted(wanted)
        blobs = self._pool.map(lambda key: self.shards.read_member(self.shards.samples[key[0]], key[1]), ordered)
        self._ahead = dict(zip(ordered, blobs, strict=True))

    def _member(self, sample: int, ext: str) -> bytes:
        blob = self._ahead.get((sample, ext))
        return blob if blob is not None else self.shards.read_member(self.shards.samples[sample], ext)

    def _tokenizer(self):
        if self._loaded_tokenizer is None:
            self._loaded_tokenizer = self.shards.tokenizer()
        return self._loaded_tokenizer

    def __getstate__(self) -> dict:
        # DataLoader workers get a copy: each loads its tokenizer (a Rust object) and starts its pool.
        return {**self.__dict__, "_loaded_tokenizer": None, "_pool": None, "_ahead": {}}


_NO_TOKENS = np.zeros(0, dtype=np.int64)


def _encode(tokenizer, text: str) -> np.ndarray:
    if not text:
        return _NO_TOKENS
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def describe(source: ShardSource) -> str:
    """One line for the run's log: what the stream holds."""
    manifest = source.shards.manifest
    return json.dumps(
        {
            "shards": len(manifest.get("shards", [])),
            "samples": len(source.shards.samples),
            "items": source.num_items,
            "audio_h": round(manifest.get("audio_s", 0.0) / 3600, 3),
            "video_h": round(manifest.get("video_s", 0.0) / 3600, 3),
        }
    )
