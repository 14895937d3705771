"""Real media files built in memory from known signals, for the decoder tests and the data benchmark.

Audio is a chirp or a pure tone (its pitch is read back with an FFT, its timing by cross-correlation);
video frames carry their own index as brightness (``ramp_frames``), so a decoded frame tells which
source instant it shows.
"""

from __future__ import annotations

import io
import os
import tempfile
from fractions import Fraction

import av
import numpy as np
import soundfile

# Brightness of source frame i is RAMP_BASE + RAMP_STEP * i (8-bit): steps of 5 survive H.264 and
# MPEG-4 quantization (off by ~1-2 levels) and the yuv420p round trip, so the index reads back exactly.
RAMP_BASE = 16
RAMP_STEP = 5


def tone(seconds: float, rate: int, freq: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def chirp(seconds: float, rate: int, f0: float = 300.0, f1: float = 1500.0, amplitude: float = 0.5) -> np.ndarray:
    """A linear sweep: no two stretches look alike, so a window misplaced by even a few samples no
    longer matches the same span of the source."""
    t = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * seconds))
    return (amplitude * np.sin(phase)).astype(np.float32)


def encode_soundfile(signal: np.ndarray, rate: int, fmt: str) -> bytes:
    """``fmt`` is "WAV", "FLAC" or "OGG" (Vorbis)."""
    out = io.BytesIO()
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS"}[fmt]
    soundfile.write(out, signal, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def ramp_frames(count: int, size: int) -> np.ndarray:
    """[count, size, size, 3] uint8 gray frames, frame i at brightness RAMP_BASE + RAMP_STEP * i."""
    levels = RAMP_BASE + RAMP_STEP * np.arange(count)
    if levels[-1] > 255:
        raise ValueError(f"at most {(255 - RAMP_BASE) // RAMP_STEP + 1} ramp frames, asked for {count}")
    return np.broadcast_to(levels[:, None, None, None], (count, size, size, 3)).astype(np.uint8)


def ramp_index(frame: np.ndarray) -> int:
    """The source index a decoded float [0, 1] ramp frame shows."""
    return round((float(frame.mean()) * 255 - RAMP_BASE) / RAMP_STEP)


def moving_frames(count: int, width: int, height: int) -> np.ndarray:
    """Frames with some texture and motion (a gradient and a sliding square), so an encoder has
    real work: a flat gray video would make the benchmark's decode rates meaninglessly high."""
    ys, xs = np.mgrid[0:height, 0:width]
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for i in range(count):
        frames[i, ..., 0] = (xs * 255 // width + 3 * i) % 256
        frames[i, ..., 1] = (ys * 255 // height) % 256
        frames[i, ..., 2] = ((xs + ys + 7 * i) // 8 % 2) * 200
        x0 = (i * 9) % max(width - 40, 1)
        frames[i, 40:80, x0 : x0 + 40] = 255
    return frames


def encode_av(
    *,
    container: str,
    video: np.ndarray | None = None,
    video_codec: str = "libx264",
    fps: int = 25,
    audio: np.ndarray | None = None,
    audio_codec: str = "aac",
    sample_rate: int = 48000,
    faststart: bool = False,
) -> bytes:
    """Encodes uint8 RGB frames [N, H, W, 3] and/or mono float32 audio into a ``container``
    ("mp4", "mp3", ...). ``faststart`` puts the mp4 index before the media, as web video does (a
    file cut short then still opens); the muxer rewrites the file by name for it, so that case goes
    through a temporary file instead of memory."""
    if not faststart:
        out = io.BytesIO()
        _mux(out, container, video, video_codec, fps, audio, audio_codec, sample_rate, {})
        return out.getvalue()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, f"faststart.{container}")
        _mux(path, container, video, video_codec, fps, audio, audio_codec, sample_rate, {"movflags": "faststart"})
        with open(path, "rb") as f:
            return f.read()


def _mux(
    out: io.BytesIO | str,
    container: str,
    video: np.ndarray | None,
    video_codec: str,
    fps: int,
    audio: np.ndarray | None,
    audio_codec: str,
    sample_rate: int,
    options: dict[str, str],
) -> None:
    with av.open(out, mode="w", format=container, options=options) as muxer:
        video_stream = _add_video(muxer, video, video_codec, fps) if video is not None else None
        audio_stream = muxer.add_stream(audio_codec, rate=sample_rate, layout="mono") if audio is not None else None
        if video_stream is not None:
            for i, rgb in enumerate(video):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
                frame.pts, frame.time_base = i, Fraction(1, fps)
                muxer.mux(video_stream.encode(frame))
            muxer.mux(video_stream.encode(None))
        if audio_stream is not None:
            _encode_audio(muxer, audio_stream, audio, sample_rate)


def _add_video(muxer: av.container.OutputContainer, video: np.ndarray, codec: str, fps: int) -> av.VideoStream:
    stream = muxer.add_stream(codec, rate=fps)
    stream.height, stream.width = video.shape[1], video.shape[2]
    stream.pix_fmt = "yuv420p"
    stream.codec_context.time_base = Fraction(1, fps)
    if codec == "mpeg4":
        stream.codec_context.bit_rate = 2_000_000
    return stream


def _encode_audio(muxer: av.container.OutputContainer, stream: av.AudioStream, audio: np.ndarray, rate: int) -> None:
    fmt = stream.codec_context.codec.audio_formats[0].name
    chunk = 1152  # any size: PyAV re-chunks to the encoder's frame size
    for start in range(0, len(audio), chunk):
        piece = np.ascontiguousarray(audio[None, start : start + chunk], dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(piece, format="fltp" if fmt == "fltp" else "flt", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
        muxer.mux(stream.encode(frame))
    muxer.mux(stream.encode(None))
