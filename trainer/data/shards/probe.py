"""Is this media file usable, and what is in it? Decodes a little of every stream, at the start and
near the end, because a header can be intact on a file whose data is garbage or cut short (an
interrupted download keeps its header; a damaged one may not)."""

from __future__ import annotations

import os
from dataclasses import dataclass

SOUNDFILE_EXTS = frozenset({"wav", "flac", "ogg"})
"""Read by libsndfile (faster than FFmpeg for plain audio); other media goes through PyAV."""
FRAMES_TO_DECODE = 3
"""Decoded frames per stream, at the head, before a file counts as decodable."""
PACKETS_TO_READ = 256
"""Most packets demuxed at the head: bounds the probe of a long file with a sparse stream."""
TAIL_SECONDS = 1.0
"""How far before the end the tail check seeks."""
OPEN_TIMEOUT_S = 30.0
"""FFmpeg's wait for data on open and on each read (matters for network filesystems)."""
_SOUNDFILE_BLOCK = 4096


class ProbeError(Exception):
    """A media file that cannot be used; the message is a short reason for skipped.jsonl."""


@dataclass(frozen=True, slots=True)
class MediaInfo:
    duration_s: float
    """The longest stream's duration, seconds."""
    has_audio: bool
    has_video: bool


def probe(path: str) -> MediaInfo:
    """What ``path`` holds; ProbeError (with a short reason) if it does not open or decode."""
    if not os.path.isfile(path):
        raise ProbeError("not a file")
    if os.path.getsize(path) == 0:
        raise ProbeError("empty file")
    ext = path.rsplit(".", 1)[-1].lower()
    if ext in SOUNDFILE_EXTS:
        try:
            return _probe_soundfile(path)
        except ProbeError:
            pass  # libsndfile lacks some codecs (e.g. opus in older builds): FFmpeg has the last word
    import av

    try:
        return _probe_av(path)
    except ProbeError:
        raise
    except av.FFmpegError as e:  # its strerror is FFmpeg's reason, without the path
        raise ProbeError(f"FFmpeg: {e.strerror or _short(e)}") from e
    except Exception as e:  # FFmpeg's errors, and PyAV's on malformed metadata: all mean "unusable"
        raise ProbeError(f"{type(e).__name__}: {_short(e)}") from e


def _probe_soundfile(path: str) -> MediaInfo:
    import soundfile

    try:
        with soundfile.SoundFile(path) as f:
            frames, rate = f.frames, f.samplerate
            if frames <= 0 or len(f.read(_SOUNDFILE_BLOCK, dtype="float32")) == 0:
                raise ProbeError("no audio frames")
            tail_start = max(0, frames - _SOUNDFILE_BLOCK)
            f.seek(tail_start)
            got = len(f.read(frames - tail_start, dtype="float32"))
    except (RuntimeError, ValueError, OSError) as e:  # soundfile.LibsndfileError is a RuntimeError
        raise ProbeError(f"libsndfile: {_short(e)}") from e
    if got != frames - tail_start:
        raise ProbeError(f"truncated: the header says {frames} frames, data ends {frames - tail_start - got} early")
    return MediaInfo(duration_s=frames / rate, has_audio=True, has_video=False)


def _probe_av(path: str) -> MediaInfo:
    import av

    with av.open(path, timeout=OPEN_TIMEOUT_S) as container:
        streams = [s for s in container.streams if s.type in ("audio", "video")]
        if not streams:
            raise ProbeError("no audio or video stream")
        _decode_head(container, streams)
        duration = _duration_s(container, streams)
        if duration > 2 * TAIL_SECONDS:
            _decode_tail(container, streams[0], duration)
        return MediaInfo(
            duration_s=duration,
            has_audio=any(s.type == "audio" for s in streams),
            has_video=any(s.type == "video" for s in streams),
        )


def _decode_head(container, streams) -> None:
    """Decode until every stream gave FRAMES_TO_DECODE frames (or the file ended with at least
    one frame each); a stream that decodes nothing makes the file unusable."""
    frames = {s.index: 0 for s in streams}
    for packets, packet in enumerate(container.demux(streams), start=1):
        frames[packet.stream.index] += len(packet.decode())  # a flush packet at EOF drains the decoder
        if min(frames.values()) >= FRAMES_TO_DECODE or packets >= PACKETS_TO_READ:
            break
    for stream in streams:
        if frames[stream.index] == 0:
            codec = stream.codec_context.name if stream.codec_context else "?"
            raise ProbeError(f"{stream.type} stream #{stream.index} ({codec}) decoded no frame")


def _decode_tail(container, stream, duration: float) -> None:
    """A file cut short keeps its index (moov at the front, mkv cues) but not its last packets."""
    target = int((duration - TAIL_SECONDS) / stream.time_base) if stream.time_base else None
    if target is None:
        return
    try:
        container.seek(target, stream=stream, any_frame=False, backward=True)
    except Exception:  # a container that cannot seek is not damaged, just unseekable
        return
    for packet in container.demux(stream):
        if packet.size:  # the data is there; decode() raises if it is garbage
            packet.decode()
            return
    raise ProbeError(f"truncated: nothing decodes in the last {TAIL_SECONDS:g} s of {duration:.2f} s")


def _duration_s(container, streams) -> float:
    per_stream = [float(s.duration * s.time_base) for s in streams if s.duration and s.time_base]
    if per_stream:
        return max(per_stream)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE
    raise ProbeError("unknown duration")


def _short(err: BaseException, limit: int = 200) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
