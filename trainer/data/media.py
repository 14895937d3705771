"""Decoders for real media files: encoded bytes (a shard's tar member) to the arrays the tokenizer takes.

Audio comes back mono float32 at 16 kHz (the tokenizer's 40 ms frames of 640 samples); video as RGB
float32 [F, size, size, 3] in [0, 1], frame j shown at ``start_s + j / fps`` (docs/shards.md).

Both work on in-memory bytes (a tar member read with one range read) and decode only the window
asked for: they seek near ``start_s`` and stop once the window is covered. Every failure of the file
itself (corrupt or truncated bytes, a missing stream, an unknown extension) is a ``MediaError``, so a
loader can skip the sample and log it instead of dying on whatever FFmpeg or libsndfile raised.

This module is the face: it checks the arguments, picks a decoder by extension and turns foreign
errors into ``MediaError``. The decoders live in ``media_audio`` (with ``media_wav``) and
``media_video``; what both FFmpeg decoders share, in ``media_stream``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np

from resilient.errors import ConfigError
from resilient.trainer.data.media_audio import decode_audio_av, decode_audio_soundfile
from resilient.trainer.data.media_stream import MediaError
from resilient.trainer.data.media_video import decode_video_av

__all__ = ["AV_AUDIO_EXTS", "SOUNDFILE_EXTS", "VIDEO_EXTS", "MediaError", "decode_audio", "decode_video"]

# libsndfile reads these fast and seeks sample-exactly; everything else goes through FFmpeg (PyAV).
# Not ogg: libsndfile 1.2's Vorbis seek lands wrong inside the stream's last pages (a read after a
# seek into the last ~0.5 s differed from a sequential read by up to 1.0 full scale); FFmpeg's is exact.
SOUNDFILE_EXTS = frozenset({"wav", "flac"})
AV_AUDIO_EXTS = frozenset({"mp4", "m4a", "mkv", "webm", "mp3", "mov", "aac", "opus", "ogg"})
VIDEO_EXTS = frozenset({"mp4", "mkv", "webm", "mov", "avi"})


def decode_audio(
    data: bytes,
    ext: str,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    sample_rate: int = 16000,
) -> np.ndarray:
    """Mono float32 samples at ``sample_rate`` covering [start_s, start_s + duration_s).

    With ``duration_s`` the result has exactly round(duration_s * sample_rate) samples, zero-padded
    where the file ends early; without it, it runs to the end of the audio. Sample k holds the audio
    of instant ``start_s + k / sample_rate``. Raises ``MediaError`` for a file that does not decode.
    """
    _check_window(start_s, duration_s)
    if sample_rate <= 0:
        raise ConfigError(f"sample_rate must be > 0, got {sample_rate}")
    ext = _normalize_ext(ext)
    if ext in SOUNDFILE_EXTS:
        decode = decode_audio_soundfile
    elif ext in AV_AUDIO_EXTS:
        decode = decode_audio_av
    else:
        raise MediaError(f"cannot decode audio from .{ext}: unknown extension (known: {_known(_audio_exts())})")
    return _guarded(ext, "audio", lambda: decode(data, ext, start_s, duration_s, sample_rate))


def decode_video(
    data: bytes,
    ext: str,
    *,
    fps: int,
    size: int,
    start_s: float = 0.0,
    duration_s: float | None = None,
    threads: int = 0,
) -> np.ndarray:
    """RGB float32 frames [F, size, size, 3] in [0, 1]: frame j is the picture on screen at
    ``start_s + j / fps`` (the latest decoded frame with pts <= that time).

    F counts the j with ``start_s + j / fps`` before both ``start_s + duration_s`` and the end of the
    stream (the last frame's pts plus its duration); video is not padded. ``threads`` is FFmpeg's
    decoder thread count, 0 for its automatic choice. Raises ``MediaError`` for a file that does not
    decode.
    """
    _check_window(start_s, duration_s)
    if fps <= 0 or size <= 0:
        raise ConfigError(f"fps and size must be > 0, got fps={fps} size={size}")
    if threads < 0:
        raise ConfigError(f"threads must be >= 0 (0 = automatic), got {threads}")
    ext = _normalize_ext(ext)
    if ext not in VIDEO_EXTS:
        raise MediaError(f"cannot decode video from .{ext}: unknown extension (known: {_known(VIDEO_EXTS)})")
    return _guarded(ext, "video", lambda: decode_video_av(data, ext, fps, size, start_s, duration_s, threads))


# ---------------------------------------------------------------------------------------------
# argument checks and the error boundary


def _check_window(start_s: float, duration_s: float | None) -> None:
    if not (math.isfinite(start_s) and start_s >= 0):
        raise ConfigError(f"start_s must be a finite number >= 0, got {start_s}")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s >= 0):
        raise ConfigError(f"duration_s must be None or a finite number >= 0, got {duration_s}")


def _normalize_ext(ext: str) -> str:
    return ext.lower().lstrip(".")


def _audio_exts() -> frozenset[str]:
    return SOUNDFILE_EXTS | AV_AUDIO_EXTS


def _known(exts: frozenset[str]) -> str:
    return ", ".join(sorted(exts))


_ADDRESS = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def _guarded(ext: str, kind: str, decode: Callable[[], np.ndarray]) -> np.ndarray:
    """Runs ``decode`` and turns every failure into one ``MediaError``. Decoders of untrusted bytes
    raise a zoo of types (av.FFmpegError and its subclasses, soundfile.LibsndfileError, RuntimeError,
    EOFError, ValueError from a header with nonsense fields...); a loader needs exactly one to catch."""
    try:
        return decode()
    except (MediaError, ConfigError):
        raise
    except (MemoryError, RecursionError):
        raise  # this process's trouble, not the file's: skipping would differ from rank to rank
    except Exception as e:  # the boundary where foreign decoder errors become ours, see above
        # Object reprs carry addresses ("<_io.BytesIO object at 0x7f..>"): the same bytes must fail
        # with the same words on every rank and every resume (the skip is logged and compared).
        reason = _ADDRESS.sub("the input", " ".join(str(e).split())) or type(e).__name__
        raise MediaError(f"cannot decode {kind} from .{ext}: {type(e).__name__}: {reason}") from e
