"""Decoders for real media files: encoded bytes (a shard's tar member) to the arrays the tokenizer takes.

Audio comes back mono float32 at 16 kHz (the tokenizer's 40 ms frames of 640 samples); video as RGB
float32 [F, size, size, 3] in [0, 1], frame j shown at ``start_s + j / fps`` (docs/shards.md).

Both work on in-memory bytes (a tar member read with one range read) and decode only the window
asked for: they seek near ``start_s`` and stop once the window is covered. Every failure of the file
itself (corrupt or truncated bytes, a missing stream, an unknown extension) is a ``MediaError``, so a
loader can skip the sample and log it instead of dying on whatever FFmpeg or libsndfile raised.

Placement on the timeline uses the decoder's timestamps (pts * time_base), not a sample count from
the seek point: AAC and MP3 start with encoder priming that the demuxer trims by an edit list, and a
seek lands on a packet boundary before ``start_s``; counting samples would shift the window by up to
a frame (~21 ms of AAC at 48 kHz).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Iterator
from fractions import Fraction

import av
import numpy as np
import soundfile

from resilient.errors import ConfigError, ResilientError

# libsndfile reads these fast and seeks sample-exactly; everything else goes through FFmpeg (PyAV).
# Not ogg: libsndfile 1.2's Vorbis seek lands wrong inside the stream's last pages (a read after a
# seek into the last ~0.5 s differed from a sequential read by up to 1.0 full scale); FFmpeg's is exact.
SOUNDFILE_EXTS = frozenset({"wav", "flac"})
AV_AUDIO_EXTS = frozenset({"mp4", "m4a", "mkv", "webm", "mp3", "mov", "aac", "opus", "ogg"})
VIDEO_EXTS = frozenset({"mp4", "mkv", "webm", "mov", "avi"})

# AAC is an MDCT codec: the first frame decoded after a seek lacks the previous frame's overlap and
# comes out wrong. Seeking this much earlier than start_s and throwing the lead-in away leaves
# several clean frames (1024 samples = 21-64 ms each at 16-48 kHz) before the window.
_AUDIO_PREROLL_S = 0.25
# Audio decoded on both sides of a window that gets resampled, so the resampler's filter sees real
# signal at the window's edges instead of a cut (its transient would otherwise land inside the window).
_RESAMPLE_MARGIN_S = 0.01
# A bound on the decode loops whatever the demuxer believes: no real file in a shard packs more
# packets than bytes, so a broken file that keeps yielding is stopped instead of spinning.
_MIN_PACKET_BUDGET = 10_000
# How much shorter than declared a decoded stream may end before it counts as truncated.
_TRUNCATION_SLACK_S = 0.1


class MediaError(ResilientError):
    """A media file that does not decode: corrupt or truncated bytes, no stream of the kind asked
    for, or an extension no decoder here handles. The message names the extension and the reason."""


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
        decode = _decode_audio_soundfile
    elif ext in AV_AUDIO_EXTS:
        decode = _decode_audio_av
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
    from resilient.trainer.data.media_video import decode_video_av  # its helpers live here

    return _guarded(ext, "video", lambda: decode_video_av(data, ext, fps, size, start_s, duration_s, threads))


# ---------------------------------------------------------------------------------------------
# shared helpers


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


def _packet_budget(data: bytes) -> int:
    return max(_MIN_PACKET_BUDGET, len(data))


# ---------------------------------------------------------------------------------------------
# audio: both decoders produce mono samples at the file's own rate over a span of the native
# timeline; one function resamples and cuts the window out of it.
#
# The span starts on the "phase grid": instants that are whole samples at both the native and the
# target rate (every 441 samples = 20 ms for 22.05 kHz -> 16 kHz, every 3 for 48 kHz). A resampler
# fed from such an instant produces output samples exactly on k / 16000 s; fed from anywhere else,
# its output is shifted by a fraction of a sample, and a window would differ from the same span of
# a full decode by up to half a sample (~0.07 rms on a 1.5 kHz tone at 16 kHz).


def _native_span(
    start_s: float, duration_s: float | None, native_rate: int, sample_rate: int
) -> tuple[int, int | None]:
    """[first, last) native sample indices to decode: the window, widened by the resampler margin,
    its start moved back onto the phase grid; last is None for "to the end"."""
    grid = native_rate // math.gcd(native_rate, sample_rate)
    margin = round(_RESAMPLE_MARGIN_S * native_rate) if native_rate != sample_rate else 0
    first = max(round(start_s * native_rate) - margin, 0) // grid * grid
    last = None if duration_s is None else math.ceil((start_s + duration_s) * native_rate) + margin
    return first, last


def _window_from_native(
    mono: np.ndarray, first: int, native_rate: int, start_s: float, duration_s: float | None, sample_rate: int
) -> np.ndarray:
    """The output window from native samples whose sample 0 is native index ``first`` (on the grid)."""
    if native_rate != sample_rate:
        mono = _resample(mono, native_rate, sample_rate)
    # first * sample_rate / native_rate is a whole number: the grid guarantees it.
    offset = first * sample_rate // native_rate - round(start_s * sample_rate)
    length = None if duration_s is None else round(duration_s * sample_rate)
    return _place([(offset, mono)], length)


def _place(pieces: list[tuple[int, np.ndarray]], length: int | None) -> np.ndarray:
    """Lays runs of samples, each with the index of its first sample, onto [0, length) (to the
    last run's end when length is None). Gaps stay zero; what falls outside is dropped."""
    if length is None:
        length = max([offset + len(samples) for offset, samples in pieces] + [0])
    out = np.zeros(length, dtype=np.float32)
    for offset, samples in pieces:
        lo, hi = max(offset, 0), min(offset + len(samples), length)
        if lo < hi:
            out[lo:hi] = samples[lo - offset : hi - offset]
    return out


def _resample(mono: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """libswresample through PyAV's AudioResampler: a windowed-sinc polyphase filter, band-limited,
    so 44.1/48 kHz -> 16 kHz does not fold the 8-24 kHz band back into the speech band as linear
    interpolation would; its output starts aligned with its input (the filter delay is compensated),
    so output sample 0 is the input's first instant."""
    if not len(mono):  # a window past the end; PyAV cannot build an empty frame
        return mono
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to_rate)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(mono[None, :]), format="flt", layout="mono")
    frame.sample_rate = from_rate
    frame.pts = 0
    frame.time_base = Fraction(1, from_rate)
    out = resampler.resample(frame) + resampler.resample(None)
    if not out:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in out]).astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------------
# audio through libsndfile (wav, flac)


def _decode_audio_soundfile(
    data: bytes, ext: str, start_s: float, duration_s: float | None, sample_rate: int
) -> np.ndarray:
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        _check_wav_complete(ext, f)
        native_rate, total = f.samplerate, f.frames
        first, last = _native_span(start_s, duration_s, native_rate, sample_rate)
        last = total if last is None else min(last, total)
        wanted = max(last - first, 0)
        if wanted:
            f.seek(first)
        samples = f.read(frames=wanted, dtype="float32", always_2d=True)
    if len(samples) < wanted:
        raise MediaError(f"cannot decode audio from .{ext}: truncated, read {len(samples)} of {wanted} frames")
    # Downmix by averaging channels: keeps a full-scale mono file full scale and never clips.
    mono = samples.mean(axis=1, dtype=np.float32)
    return _window_from_native(mono, first, native_rate, start_s, duration_s, sample_rate)


def _check_wav_complete(ext: str, f: soundfile.SoundFile) -> None:
    """A WAV cut short still opens (libsndfile reads what is there); its header's data size gives it
    away, which libsndfile reports as "data : N (should be M)". Sizes 0 and 0xFFFFFFFF are the
    placeholders of a WAV written to a pipe, complete but unsized, and pass."""
    found = re.search(r"^data : (\d+) \(should be (\d+)\)", f.extra_info, flags=re.MULTILINE)
    if found and int(found[1]) not in (0, 0xFFFFFFFF) and int(found[2]) < int(found[1]):
        raise MediaError(
            f"cannot decode audio from .{ext}: truncated, the header declares {found[1]} bytes of audio, "
            f"the file holds {found[2]}"
        )


# ---------------------------------------------------------------------------------------------
# audio through FFmpeg (audio tracks of mp4/m4a/mkv/webm, mp3, ogg)


def _decode_audio_av(data: bytes, ext: str, start_s: float, duration_s: float | None, sample_rate: int) -> np.ndarray:
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            raise MediaError(f"cannot decode audio from .{ext}: the file has no audio stream")
        stream = container.streams.audio[0]
        native_rate = stream.codec_context.sample_rate
        if not native_rate:
            raise MediaError(f"cannot decode audio from .{ext}: the audio stream has no sample rate")
        first, last = _native_span(start_s, duration_s, native_rate, sample_rate)
        origin = _timeline_origin(container)
        seek_s = first / native_rate - _AUDIO_PREROLL_S
        if seek_s > 0 and _sample_exact_timestamps(stream, native_rate):
            # backward=True lands on the last packet at or before seek_s, so nothing of the span is missed.
            container.seek(_to_pts(seek_s + origin, stream.time_base), stream=stream, backward=True)
        timeline = _AudioTimeline(origin=origin, rate=native_rate)
        for frame in _decoded_frames(container, stream, _packet_budget(data)):
            if frame.pts is None:
                raise MediaError(f"cannot decode audio from .{ext}: a decoded frame has no timestamp")
            timeline.add(frame)
            if last is not None and timeline.end >= last:
                break
        else:  # decoded to the end of the file: it must be as long as its header says
            declared_s = _declared_duration(container, stream)
            _check_complete(ext, declared_s, timeline.end / native_rate)
            if last is None and declared_s is not None:
                # AAC pads its last frame to 1024 samples; the declared duration is where the audio ends.
                last = min(timeline.end, round(declared_s * native_rate))
    if last is None:
        last = timeline.end
    last = max(last, first)
    mono = _place([(offset - first, samples) for offset, samples in timeline.pieces], last - first)
    return _window_from_native(mono, first, native_rate, start_s, duration_s, sample_rate)


def _sample_exact_timestamps(stream: av.audio.stream.AudioStream, native_rate: int) -> bool:
    """Whether a packet's pts names its first sample exactly. Matroska/WebM store milliseconds: the
    first frame after a seek would be placed up to 0.5 ms (8 samples at 16 kHz) off, so for them
    the decode runs from the file's start, where time 0 is exact and the frames after it follow
    contiguously. Costs decode time proportional to start_s (AAC decodes at ~500x realtime)."""
    return stream.time_base is not None and stream.time_base <= Fraction(1, native_rate)


def _declared_duration(container: av.container.InputContainer, stream: av.stream.Stream) -> float | None:
    """The stream's length as its header declares it (mp4 index, MP3 Xing frame count), or the
    container's when the stream is its only one (matroska keeps only the segment's). None when
    nothing trustworthy is declared: a container's length with several streams is the longest
    one's, and audio may legitimately end before the video."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration and len(container.streams) == 1:
        return container.duration / av.time_base
    return None


def _check_complete(ext: str, declared_s: float | None, decoded_s: float, kind: str = "audio") -> None:
    """A file cut short (a partial download) often still demuxes: the packets just stop. Decoding
    to its end and finding less than the header declared says so. Slack: codec frame padding and
    bitrate-estimated MP3 lengths are off by a little, a truncation by much more."""
    if declared_s is not None and decoded_s < declared_s - max(_TRUNCATION_SLACK_S, 0.02 * declared_s):
        raise MediaError(
            f"cannot decode {kind} from .{ext}: truncated, the header declares {declared_s:.3f} s, "
            f"the stream ends at {decoded_s:.3f} s"
        )


def _timeline_origin(container: av.container.InputContainer) -> float:
    """Seconds of the file's first presented instant, which becomes time 0. MP3 reports its first
    frame at the encoder+decoder delay (~25 ms) after skipping those samples; AAC in mp4 reports 0
    after its edit list trims the priming. Subtracting the container's start (not a stream's) keeps
    audio and video of one file on one clock, as ffmpeg does when it rebases timestamps."""
    return container.start_time / av.time_base if container.start_time is not None else 0.0


class _AudioTimeline:
    """Decoded frames as mono float32 runs at the native rate, each with the native sample index of
    its first sample (pts * time_base, less the origin). Runs follow each other contiguously from
    the first one's timestamp: matroska stores pts in milliseconds, and placing every 21 ms AAC
    frame by its rounded pts would open or overlap a few samples at each seam. Only a jump larger
    than _GAP_S (a real hole in the stream) is placed by its timestamp."""

    _GAP_S = 0.02

    def __init__(self, *, origin: float, rate: int) -> None:
        self.origin, self.rate = origin, rate
        self.pieces: list[tuple[int, np.ndarray]] = []
        self.end = 0
        # Converts any sample format and channel layout to float planes at the native rate (no rate
        # change, so no filter delay); the channels are then averaged like the soundfile path does.
        self._to_float = av.AudioResampler(format="fltp", rate=rate)

    def add(self, frame: av.AudioFrame) -> None:
        stamped = round((float(frame.pts * frame.time_base) - self.origin) * self.rate)
        start = stamped if not self.pieces or abs(stamped - self.end) > self._GAP_S * self.rate else self.end
        for converted in self._to_float.resample(frame):
            mono = converted.to_ndarray().mean(axis=0, dtype=np.float32)
            self.pieces.append((start, mono))
            start += len(mono)
        self.end = start


def _packets(container: av.container.InputContainer, stream: av.stream.Stream, budget: int) -> Iterator[av.Packet]:
    """Packets of one stream, at most ``budget`` of them (see _MIN_PACKET_BUDGET), then the empty
    packet that flushes the decoder's delayed frames."""
    for count, packet in enumerate(container.demux(stream)):
        if count >= budget:
            raise MediaError(f"gave up after {budget} packets: the stream does not end")
        yield packet


def _decoded_frames(container: av.container.InputContainer, stream: av.stream.Stream, budget: int) -> Iterator:
    """Decoded frames of one stream, at most ``budget`` packets' worth."""
    for packet in _packets(container, stream, budget):
        yield from packet.decode()


def _to_pts(seconds: float, time_base: Fraction | None) -> int:
    if not time_base:
        raise MediaError("the stream has no time base to seek by")
    return int(Fraction(seconds).limit_denominator(1_000_000) / time_base)
