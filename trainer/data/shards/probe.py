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
TAIL_SLACK_S = 0.25
"""How far short of the stated duration the last packet may end (container rounding)."""
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
        info = _probe_soundfile(path)
        if info is not None:
            return info
    import av

    try:
        return _probe_av(path)
    except ProbeError:
        raise
    except av.FFmpegError as e:  # its strerror is FFmpeg's reason, without the path
        raise ProbeError(f"FFmpeg: {e.strerror or _short(e)}") from e
    except Exception as e:  # PyAV's own errors on malformed data (ValueError, UnicodeDecodeError, ...)
        raise ProbeError(f"{type(e).__name__}: {_short(e)}") from e


def _probe_soundfile(path: str) -> MediaInfo | None:
    """None when libsndfile cannot open the file (some builds lack a codec, e.g. opus): FFmpeg
    then has the last word. A file it opens but cannot read to the end is damaged."""
    import soundfile

    try:
        f = soundfile.SoundFile(path)
    except (RuntimeError, ValueError, OSError):  # soundfile.LibsndfileError is a RuntimeError
        return None
    with f:
        frames, rate = f.frames, f.samplerate
        try:
            head = len(f.read(_SOUNDFILE_BLOCK, dtype="float32"))
            tail_start = max(0, frames - _SOUNDFILE_BLOCK)
            f.seek(tail_start)
            tail = len(f.read(frames - tail_start, dtype="float32"))
        except (RuntimeError, ValueError, OSError) as e:
            raise ProbeError(f"truncated or damaged: libsndfile: {_short(e)}") from e
    if frames <= 0 or head == 0:
        raise ProbeError("no audio frames")
    if tail != frames - tail_start:
        raise ProbeError(
            f"truncated: the header says {frames} frames, the data ends {frames - tail_start - tail} early"
        )
    return MediaInfo(duration_s=frames / rate, has_audio=True, has_video=False)


def _probe_av(path: str) -> MediaInfo:
    import av

    with av.open(path, timeout=OPEN_TIMEOUT_S) as container:
        streams = [s for s in container.streams if s.type in ("audio", "video")]
        if not streams:
            raise ProbeError("no audio or video stream")
        _decode_head(container, streams)
        duration = _duration_s(container, streams)
        longest = max(streams, key=lambda s: float(s.duration * s.time_base) if s.duration and s.time_base else 0.0)
        if duration > 2 * TAIL_SECONDS:
            _read_tail(container, longest, duration)
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


def _read_tail(container, stream, duration: float) -> None:
    """A file cut short can keep its index (mp4 with moov in front, mkv cues) but not its last
    packets. Seek to any frame (not the keyframe before it, which may be the file's first)
    TAIL_SECONDS before the end and read the packets from there on: they must reach the end."""
    if not stream.time_base:
        return
    try:
        container.seek(int((duration - TAIL_SECONDS) / stream.time_base), stream=stream, any_frame=True)
    except Exception:  # a container that cannot seek is not damaged, just unseekable
        return
    reached = 0.0
    try:
        for packet in container.demux(stream):
            if packet.size and packet.pts is not None:
                reached = max(reached, float((packet.pts + (packet.duration or 0)) * stream.time_base))
    except Exception as e:  # FFmpeg's read error on a packet cut in half
        raise ProbeError(f"truncated: reading the last {TAIL_SECONDS:g} s failed: {_short(e)}") from e
    if not reached:
        raise ProbeError(f"truncated: no packet in the last {TAIL_SECONDS:g} s of its {duration:.2f} s")
    if reached < duration - TAIL_SLACK_S - _frame_interval_s(stream):
        raise ProbeError(f"truncated: the data ends at {reached:.2f} s of its {duration:.2f} s")


def _frame_interval_s(stream) -> float:
    """A packet without a duration ends where it starts: allow one frame more of slack."""
    rate = getattr(stream, "average_rate", None) if stream.type == "video" else None
    return 1.0 / float(rate) if rate else 0.0


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
