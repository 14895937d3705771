"""Audio for ``resilient.trainer.data.media.decode_audio``: mono float32 at the asked rate over a
window of the source timeline, from wav/flac (read directly or through libsndfile) or any audio
track FFmpeg decodes.

Every decoder produces mono samples at the file's own rate over a span of the native timeline; one
converter resamples them (the FFmpeg path feeds it as frames are decoded, never holding the span
whole at the native rate) and the window is cut out of its output. The span starts on the "phase grid": instants
that are whole samples at both the native and the target rate (every 441 samples = 20 ms for
22.05 kHz -> 16 kHz, every 3 for 48 kHz). A resampler fed from such an instant produces output
samples exactly on k / 16000 s; fed from anywhere else, its output is shifted by a fraction of a
sample, and a window would differ from the same span of a full decode by up to half a sample
(~0.07 rms on a 1.5 kHz tone at 16 kHz).

Placement on the timeline uses the decoder's timestamps (pts * time_base), not a sample count from
the seek point: AAC and MP3 start with encoder priming that the demuxer trims by an edit list, and a
seek lands on a packet boundary before ``start_s``; counting samples would shift the window by up to
a frame (~21 ms of AAC at 48 kHz).
"""

from __future__ import annotations

import io
import itertools
import math
import re
from collections.abc import Iterable, Iterator
from fractions import Fraction

import av
import numpy as np
import soundfile
import soxr

from resilient.trainer.data.media_stream import (
    MediaError,
    bounded_packets,
    check_complete,
    declared_duration,
    only_stream,
    packet_budget,
    seek_pts,
    timeline_origin,
)
from resilient.trainer.data.media_wav import read_wav

# AAC is an MDCT codec: the first frame decoded after a seek lacks the previous frame's overlap and
# comes out wrong. Seeking this much earlier than start_s and throwing the lead-in away leaves
# several clean frames (1024 samples = 21-64 ms each at 16-48 kHz) before the window.
_AUDIO_PREROLL_S = 0.25
# Audio decoded on both sides of a window that gets resampled, so the resampler's filter sees real
# signal at the window's edges instead of a cut (its transient would otherwise land inside the window).
_RESAMPLE_MARGIN_S = 0.01
# Opening a file decodes a few frames of every stream to learn their parameters; an mp4's H.264
# track costs more to probe that way than its whole AAC track costs to decode. These options reach
# only those probe decoders (not the one that decodes the audio): video decoders then skip every
# frame, audio decoders do not look at skip_frame.
PROBE_AUDIO_ONLY = {"skip_frame": "all"}
# The open tried first: no probe decoder opens at all (none is on the whitelist), and the stream's
# parameters are its headers'. The probe's own decoder open and decode are the cost saved
# (benchmarks/README.md, "AAC, fourth pass"). Where the headers lack the rate or channels (raw ADTS) or the
# first decoded frame disagrees with them (HE-AAC signalled implicitly: the header gives the core
# rate, the decoder doubles it), the file is opened again with PROBE_AUDIO_ONLY and decoded anew.
PROBE_HEADERS_ONLY = {**PROBE_AUDIO_ONLY, "codec_whitelist": "none"}
# Native samples handed to the resampler per call: libsoxr's output does not depend on how its
# input is cut (tests hold it), and pieces of this size keep its work in cache while decoding goes
# on (larger ones cost more per sample; benchmarks/README.md, data_bench).
RESAMPLE_CHUNK = 1 << 15
# The FIFO is fed on once it holds this many samples, all of it: with the next frame it then stays
# within RESAMPLE_CHUNK, where its buffer stops growing (FFmpeg doubles it when full).
_DRAIN_AT = RESAMPLE_CHUNK - 4096
# libsoxr's "HQ" recipe (its default): flat further up the band and far more rejection of what lies
# above the output's Nyquist frequency than libswresample's default filter (the one it replaced), so
# no clip decodes worse than before; "MQ" saves little and is less accurate at 44.1 kHz, "LQ" rolls
# off earlier (figures and commands: benchmarks/README.md, AAC third pass).
RESAMPLE_QUALITY = "HQ"
# The largest output (samples) a _RateConverter allocates whole up front: 17 minutes at 16 kHz.
_PREALLOCATE_MAX = 1 << 24
# A timestamp no frame has (a frame's pts is an int or None).
_NO_PTS = object()


def native_span(start_s: float, duration_s: float | None, native_rate: int, sample_rate: int) -> tuple[int, int | None]:
    """[first, last) native sample indices to decode: the window, widened by the resampler margin,
    its start moved back onto the phase grid; last is None for "to the end"."""
    grid = native_rate // math.gcd(native_rate, sample_rate)
    margin = round(_RESAMPLE_MARGIN_S * native_rate) if native_rate != sample_rate else 0
    first = max(round(start_s * native_rate) - margin, 0) // grid * grid
    last = None if duration_s is None else math.ceil((start_s + duration_s) * native_rate) + margin
    return first, last


def window_from_native(
    mono: np.ndarray, first: int, native_rate: int, start_s: float, duration_s: float | None, sample_rate: int
) -> np.ndarray:
    """The output window from native samples whose sample 0 is native index ``first`` (on the grid)."""
    return place_window(resample(mono, native_rate, sample_rate), first, native_rate, start_s, duration_s, sample_rate)


def place_window(
    samples: np.ndarray, first: int, native_rate: int, start_s: float, duration_s: float | None, sample_rate: int
) -> np.ndarray:
    """The output window from samples at ``sample_rate`` whose sample 0 is native index ``first``."""
    # first * sample_rate / native_rate is a whole number: the grid guarantees it.
    offset = first * sample_rate // native_rate - round(start_s * sample_rate)
    length = None if duration_s is None else round(duration_s * sample_rate)
    return _place(samples, offset, length)


def _place(samples: np.ndarray, offset: int, length: int | None) -> np.ndarray:
    """``samples`` laid onto [0, length) with its first sample at ``offset`` (to its end when length
    is None): what falls outside is dropped, what it does not cover stays zero. A run that is
    exactly the window is returned as it is (every decoder hands over an array of its own)."""
    if length is None:
        length = max(offset + len(samples), 0)
    if offset == 0 and len(samples) == length:
        return samples
    out = np.zeros(length, dtype=np.float32)
    lo, hi = max(offset, 0), min(offset + len(samples), length)
    if lo < hi:
        out[lo:hi] = samples[lo - offset : hi - offset]
    return out


def resample(mono: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """``mono`` at ``to_rate`` (the same array when the rates are equal)."""
    converter = _RateConverter(from_rate, to_rate, expected=len(mono))
    converter.feed(mono)
    return converter.result()


class _RateConverter:
    """Mono float samples fed piece by piece, as they come, and handed back at the target rate.

    libsoxr's streaming resampler at RESAMPLE_QUALITY: a linear-phase band-limited filter, so
    44.1/48 kHz -> 16 kHz does not fold the 8-24 kHz band back into the speech band as linear
    interpolation would; its output starts aligned with its input (the filter delay is compensated),
    so output sample 0 is the first piece's first instant, and N samples in give round(N * to_rate /
    from_rate) out. How the input is cut into pieces does not change the output, nor does the
    process (tests hold both); each call gets at most RESAMPLE_CHUNK samples.

    With ``expected``, the most samples that will be fed, the output is written into one array of
    that size at the target rate as it comes, instead of kept in pieces and joined at the end: the
    pieces and the join took fresh memory pages on every decode (glibc hands the heap back between
    decodes), which cost more than the copies. More samples than expected are still taken."""

    def __init__(self, from_rate: int, to_rate: int, *, expected: int | None = None) -> None:
        self.stream = (
            soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32", quality=RESAMPLE_QUALITY)
            if from_rate != to_rate
            else None
        )
        self.out: list[np.ndarray] = []  # resampled pieces, or the pieces themselves
        self.fed = 0
        size = None if expected is None or self.stream is None else round(max(expected, 0) * to_rate / from_rate)
        # (A header declaring more than this is not trusted with the memory: pieces, as without one.)
        self._whole = np.empty(size, dtype=np.float32) if size is not None and size <= _PREALLOCATE_MAX else None
        self._filled = 0  # output samples written into _whole

    def feed(self, samples: np.ndarray) -> None:
        if self.stream is None:
            self.out.append(samples)
            return
        for begin in range(0, len(samples), RESAMPLE_CHUNK):
            self._keep(self.stream.resample_chunk(samples[begin : begin + RESAMPLE_CHUNK]))
        self.fed += len(samples)

    def _keep(self, piece: np.ndarray) -> None:
        whole, filled = self._whole, self._filled
        if whole is not None and filled + len(piece) <= len(whole):
            whole[filled : filled + len(piece)] = piece
            self._filled = filled + len(piece)
            return
        if whole is not None:  # more than expected: what was written becomes the first piece
            self.out.append(whole[:filled])
            self._whole = None
        self.out.append(piece)

    def result(self) -> np.ndarray:
        if self.stream is not None and self.fed:
            self._keep(self.stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
        if self._whole is not None:
            # Less than expected (a stream ending before its header says) is copied out of the
            # larger array unless that wastes little.
            filled = self._whole[: self._filled]
            return filled if 2 * self._filled >= len(self._whole) else filled.copy()
        if len(self.out) == 1 and self.out[0].flags.writeable:  # (not a view of a decoder's buffer)
            return self.out[0]
        if not self.out:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(self.out).astype(np.float32, copy=False)


def _downmix(samples: np.ndarray) -> np.ndarray:
    """[frames, channels] float32 to mono by averaging channels: keeps a full-scale mono file full
    scale and never clips. One channel is returned as it is (the mean of one value is that value)."""
    if samples.shape[1] == 1:
        return samples.reshape(-1)
    return samples.mean(axis=1, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# wav and flac


def decode_audio_soundfile(
    data: bytes, ext: str, start_s: float, duration_s: float | None, sample_rate: int
) -> np.ndarray:
    """wav and flac. Plain PCM wav is read straight from the bytes (its samples are where the header
    says); everything else goes through libsndfile, which seeks sample-exactly."""
    wav = read_wav(data, ext) if ext == "wav" else None
    if wav is not None:
        first, last = native_span(start_s, duration_s, wav.rate, sample_rate)
        mono = _downmix(wav.frames(first, wav.length if last is None else min(last, wav.length)))
        return window_from_native(mono, first, wav.rate, start_s, duration_s, sample_rate)
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        _check_wav_complete(ext, f)
        native_rate, total = f.samplerate, f.frames
        first, last = native_span(start_s, duration_s, native_rate, sample_rate)
        last = total if last is None else min(last, total)
        wanted = max(last - first, 0)
        if wanted:
            f.seek(first)
        samples = f.read(frames=wanted, dtype="float32", always_2d=True)
    if len(samples) < wanted:
        raise MediaError(f"cannot decode audio from .{ext}: truncated, read {len(samples)} of {wanted} frames")
    return window_from_native(_downmix(samples), first, native_rate, start_s, duration_s, sample_rate)


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


def decode_audio_av(data: bytes, ext: str, start_s: float, duration_s: float | None, sample_rate: int) -> np.ndarray:
    try:
        return _decode_audio_av(data, ext, start_s, duration_s, sample_rate, PROBE_HEADERS_ONLY)
    except _HeadersDisagree:
        return _decode_audio_av(data, ext, start_s, duration_s, sample_rate, PROBE_AUDIO_ONLY)


class _HeadersDisagree(Exception):
    """Opened with PROBE_HEADERS_ONLY, the stream's headers do not give what its decoder gives."""


def _decode_audio_av(
    data: bytes, ext: str, start_s: float, duration_s: float | None, sample_rate: int, probe: dict[str, str]
) -> np.ndarray:
    with av.open(io.BytesIO(data), mode="r", options=probe) as container:
        if not container.streams.audio:
            raise MediaError(f"cannot decode audio from .{ext}: the file has no audio stream")
        stream = container.streams.audio[0]
        only_stream(container, stream)
        native_rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
        if probe is PROBE_HEADERS_ONLY and not (native_rate and channels):
            raise _HeadersDisagree
        if not native_rate:
            raise MediaError(f"cannot decode audio from .{ext}: the audio stream has no sample rate")
        first, last = native_span(start_s, duration_s, native_rate, sample_rate)
        origin = timeline_origin(container)
        seek_s = first / native_rate - _AUDIO_PREROLL_S
        if seek_s > 0 and _sample_exact_timestamps(stream, native_rate):
            # backward=True lands on the last packet at or before seek_s, so nothing of the span is missed.
            container.seek(seek_pts(seek_s + origin, stream.time_base), stream=stream, backward=True)
        declared_s = declared_duration(container, stream)
        # AAC pads its last frame to 1024 samples; the declared duration is where the audio ends.
        declared_end = None if declared_s is None else round(declared_s * native_rate)
        cap = declared_end if last is None else last
        converter = _RateConverter(native_rate, sample_rate, expected=None if cap is None else cap - first)
        timeline = _AudioTimeline(origin=origin, rate=native_rate, first=first, cap=cap, out=converter)
        # One list of frames per packet, decoded by the codec context itself (packet.decode() goes
        # through two more Python-level calls per packet).
        demuxed, check_ended = bounded_packets(container, stream, packet_budget(data))
        decoded = map(stream.codec_context.decode, demuxed)
        if probe is PROBE_HEADERS_ONLY:
            decoded = _as_headers_say(decoded, native_rate, channels)
        if not timeline.lay(decoded, stop=last, ext=ext):
            check_ended()
            # decoded to the end of the file: it must be as long as its header says
            check_complete(ext, declared_s, timeline.end / native_rate)
            if last is None and declared_end is not None:
                last = min(timeline.end, declared_end)
    if last is None:
        last = timeline.end
    samples = timeline.finish(max(last, first))
    return place_window(samples, first, native_rate, start_s, duration_s, sample_rate)


def _as_headers_say(decoded: Iterator[list[av.AudioFrame]], rate: int, channels: int) -> Iterator[list[av.AudioFrame]]:
    """``decoded`` as it comes, once its first frame has the headers' rate and channels (else
    _HeadersDisagree). Decodes ahead up to that frame; the rest is not touched (no Python per packet)."""
    ahead = []
    for frames in decoded:
        ahead.append(frames)
        if frames:
            if frames[0].sample_rate != rate or frames[0].layout.nb_channels != channels:
                raise _HeadersDisagree
            break
    return itertools.chain(ahead, decoded)


def _sample_exact_timestamps(stream: av.audio.stream.AudioStream, native_rate: int) -> bool:
    """Whether a packet's pts names its first sample exactly. Matroska/WebM store milliseconds: the
    first frame after a seek would be placed up to 0.5 ms (8 samples at 16 kHz) off, so for them
    the decode runs from the file's start, where time 0 is exact and the frames after it follow
    contiguously. Costs decode time proportional to start_s (AAC decodes at ~500x realtime)."""
    return stream.time_base is not None and stream.time_base <= Fraction(1, native_rate)


class _AudioTimeline:
    """Decoded frames laid on the native timeline and fed on, mono, as they come: native samples
    [first, cap) go to a _RateConverter in order, what no frame covers as zeros, so the clip is never
    held whole at the native rate (a 48 kHz clip held whole costs more in fresh memory pages than
    resampling it).

    A frame is placed by its timestamp (pts * time_base, less the origin) when it starts a run, and
    follows the previous frame contiguously otherwise: Matroska stores pts in milliseconds, and
    placing every 21 ms AAC frame by its rounded pts would open or overlap a few samples at each
    seam; only a jump larger than _GAP_S (a real hole in the stream) starts a new run, placed by its
    timestamp. A run that goes back in time (a broken stream) does not overwrite what was decoded
    before it: only its samples past those are used.

    The current run's samples wait in an FFmpeg sample FIFO: per frame, one call copies every
    channel out of the decoder's buffer (which it then reuses), with no Python object per plane;
    per-frame work in Python is most of what a 21 ms AAC frame costs after the decoder itself."""

    _GAP_S = 0.02

    def __init__(self, *, origin: float, rate: int, first: int, cap: int | None, out: _RateConverter) -> None:
        self.origin, self.rate = origin, rate
        self.cap = cap  # no native sample at or past it is fed (None: no bound)
        self.out = out
        self.fed = first  # the next native index to feed: everything before it is fed or dropped
        self.end = 0  # past the furthest decoded sample
        self._fifo = av.AudioFifo()
        self._channels = 0  # of the frames the FIFO takes (0: none yet)
        # None while the frames are float planes at the native rate (AAC, MP3, Vorbis and Opus
        # decode to those): they go to the FIFO as decoded. Else it converts them to that (no rate
        # change, so no filter delay; no layout change: channels are averaged as the wav/flac path
        # averages them).
        self._to_float: av.AudioResampler | None = None
        self._head: int | None = None  # native index of the FIFO's first sample
        self._tail = 0  # native index past the FIFO's last sample
        self._gap = self._GAP_S * rate
        self._tick: tuple[int, int] | None = None  # the frames' time base as (numerator, denominator)
        self._next_pts: object = _NO_PTS  # the pts of a frame that would follow the last one exactly

    def lay(self, decoded: Iterable[list[av.AudioFrame]], *, stop: int | None = None, ext: str = "") -> bool:
        """Lays the frames of ``decoded`` (one list per packet, as a decoder returns them) on the
        timeline and feeds on every chunk they complete, until the timeline reaches native index
        ``stop``: True if it did, False if the frames ran out first. A frame without a timestamp is
        an error (``ext`` names the file's kind in it)."""
        # The loop runs once per 21 ms AAC frame, and its Python is most of what such a frame costs
        # after the decoder: every name it touches is a local, and a frame that follows the previous
        # one exactly (its pts is the previous pts plus its samples, with the same channels: mp4,
        # where the time base is 1 / rate) skips placement.
        stop = math.inf if stop is None else stop
        fifo, to_float, channels, next_pts = self._fifo, self._to_float, self._channels, self._next_pts
        counts_samples, end, tail = self._tick == (1, self.rate), self.end, self._tail
        for frames in decoded:
            for frame in frames:
                pts = frame.pts
                if pts != next_pts or frame.layout.nb_channels != channels:
                    if pts is None:
                        raise MediaError(f"cannot decode audio from .{ext}: a decoded frame has no timestamp")
                    self._tail, self.end = tail, end
                    tail = self._place(frame)
                    fifo, to_float, channels = self._fifo, self._to_float, self._channels
                    counts_samples = self._tick == (1, self.rate)
                start = tail
                if to_float is None:
                    frame.pts = None  # the FIFO would check it against a count from 0; placement is done here
                    fifo.write(frame)
                    tail += frame.samples
                else:
                    for converted in to_float.resample(frame):
                        converted.pts = None
                        fifo.write(converted)
                        tail += converted.samples
                next_pts = pts + tail - start if counts_samples else _NO_PTS
                if tail > end:
                    end = tail
                if fifo.samples >= _DRAIN_AT:
                    self._drain()
                if end >= stop:
                    break
            else:
                continue
            break
        self._tail, self.end, self._next_pts = tail, end, next_pts
        return end >= stop

    def _place(self, frame: av.AudioFrame) -> int:
        """Where a frame that does not follow the previous one exactly starts: at the end of the run
        if its timestamp is within _GAP_S of it, else at its timestamp, starting a new run (what the
        FIFO holds of the old one is fed on first). A frame with other channels than the FIFO's
        gets a FIFO of its own, after the old one is fed on."""
        tick = self._tick
        if tick is None:
            tick = self._tick = (frame.time_base.numerator, frame.time_base.denominator)
        # Integer true division rounds once, exactly as float(Fraction(pts * numerator, denominator)).
        stamped = round((frame.pts * tick[0] / tick[1] - self.origin) * self.rate)
        if self._head is None or abs(stamped - self._tail) > self._gap:
            self._drain()
            self._head = self._tail = stamped
        if frame.layout.nb_channels != self._channels:
            self._drain()
            self._fifo, self._channels = av.AudioFifo(), frame.layout.nb_channels
            float_planes = frame.format.name == "fltp" and frame.sample_rate == self.rate
            self._to_float = None if float_planes else av.AudioResampler(format="fltp", rate=self.rate)
        return self._tail

    def finish(self, last: int) -> np.ndarray:
        """Native samples [first, min(last, fed)) at the converter's rate, holes fed as zeros. What
        no frame covered past the last decoded sample is left to the window's placement, which
        zero-fills it: through the resampler, silence would come back as its rounding noise
        (libsoxr convolves by FFT: not exact zeros where the input is all zeros), not as silence."""
        self.cap = last if self.cap is None else min(self.cap, last)
        self._drain()
        return self.out.result()

    def _drain(self) -> None:
        """Feeds all of the FIFO's samples on, at most RESAMPLE_CHUNK at a time."""
        while self._fifo.samples:
            frame = self._fifo.read(min(RESAMPLE_CHUNK, self._fifo.samples))
            lo = self._head
            self._head += frame.samples
            start, stop = max(lo, self.fed), self._head if self.cap is None else min(self._head, self.cap)
            if start >= stop:
                continue  # before the span (a seek's lead-in), past its cap, or decoded already
            if start > self.fed:  # a hole in the stream
                self.out.feed(np.zeros(start - self.fed, dtype=np.float32))
            if len(frame.planes) == 1:  # a view of the FIFO's fresh frame, sliced: no copy, no vstack
                self.out.feed(np.frombuffer(frame.planes[0], np.float32, frame.samples)[start - lo : stop - lo])
            else:
                self.out.feed(_mix(frame.to_ndarray()[:, start - lo : stop - lo]))
            self.fed = stop


def _mix(planes: np.ndarray) -> np.ndarray:
    """[channels, samples] float32 to mono, as ``_downmix`` does for [samples, channels]."""
    return planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
