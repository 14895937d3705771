"""media_audio and media_wav below the face: the direct WAV read returns libsndfile's values bit for
bit; the resampler is band-limited, within a stated tolerance of the exact signal and of the
resampler it replaced, and its output depends neither on how its input is cut into calls nor on the
process that runs it; decoded frames are laid onto the native timeline by their timestamps (holes
zero; a run that goes back in time adds only what lies past the decoded part); and the options that
spare the open from probing video leave the audio untouched."""

from __future__ import annotations

import hashlib
import io
import struct
import subprocess
import sys
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile
import soxr

from resilient.trainer.data import media_audio
from resilient.trainer.data.media import MediaError, decode_audio
from resilient.trainer.data.media_wav import read_wav
from tests.trainer.data import media_samples as samples


def _wav(signal: np.ndarray, rate: int, subtype: str) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, signal, rate, format="WAV", subtype=subtype)
    return out.getvalue()


def _stereo(seconds: float, rate: int) -> np.ndarray:
    # Full-scale peaks and a quiet tone: the extremes and the low bits of every sample width.
    left = samples.chirp(seconds, rate, amplitude=0.999)
    right = samples.tone(seconds, rate, 700.0, amplitude=0.001)
    return np.stack([left, right], axis=1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24", "PCM_32", "FLOAT"])
@pytest.mark.parametrize("channels", [1, 2])
def test_direct_wav_read_equals_libsndfile(subtype: str, channels: int) -> None:
    signal = _stereo(1.0, 16000)[:, :channels]
    data = _wav(signal, 16000, subtype)
    wav = read_wav(data, "wav")
    assert wav is not None and (wav.rate, wav.channels, wav.length) == (16000, channels, 16000)
    expected = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)[0]
    got = wav.frames(0, wav.length)
    assert got.dtype == np.float32 and np.array_equal(got, expected)
    assert np.array_equal(wav.frames(1234, 5678), expected[1234:5678])
    assert wav.frames(20000, 30000).shape == (0, channels)  # past the end: nothing, not an error


@pytest.mark.timeout(30)
def test_wav_the_direct_read_does_not_know_goes_through_libsndfile() -> None:
    signal = _stereo(1.0, 16000)
    for subtype in ("PCM_U8", "DOUBLE", "ULAW"):
        data = _wav(signal, 16000, subtype)
        assert read_wav(data, "wav") is None
        expected = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)[0].mean(axis=1, dtype=np.float32)
        assert np.array_equal(decode_audio(data, "wav"), expected)


@pytest.mark.timeout(30)
def test_direct_wav_read_refuses_a_cut_file_and_accepts_an_unsized_one() -> None:
    data = _wav(samples.tone(1.0, 16000, 440.0), 16000, "PCM_16")
    with pytest.raises(MediaError, match=r"\.wav: truncated, the header declares 32000 bytes of audio, the file holds"):
        decode_audio(data[:20000], "wav")
    position = data.index(b"data") + 4
    unsized = data[:position] + (0xFFFFFFFF).to_bytes(4, "little") + data[position + 4 :]
    assert np.array_equal(decode_audio(unsized, "wav"), decode_audio(data, "wav"))


# How far libsoxr's output (the resampler since it replaced libswresample) may stray, for content
# below 3/4 of the output's Nyquist frequency, from the exact band-limited signal and from what
# libswresample gave: above both resamplers' errors there (libsoxr's passband droops a little at
# 44.1 -> 16 kHz), far under the coding noise of a lossy soundtrack, and an upper bound on how much
# a decoded window changed with the resampler (away from a clip's ends, see EDGE_S). The errors
# measured: benchmarks/README.md, AAC third pass.
RESAMPLE_TOLERANCE = 1e-3
# The ends of a resampled clip: the filters' responses to the cut reach this far in and are each
# filter's own (libsoxr's is longer), so the tolerance holds from here on.
EDGE_S = 0.02


def _tones(seconds: float, rate: int, freqs: list[float]) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return sum(0.3 * np.sin(2 * np.pi * f * t + i) for i, f in enumerate(freqs))


def _swr(signal: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """The resampler the decoders used before libsoxr: libswresample through PyAV, one call."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to_rate)
    frame = av.AudioFrame.from_ndarray(signal[None, :], format="flt", layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = from_rate, 0, Fraction(1, from_rate)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in resampler.resample(frame) + resampler.resample(None)])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("from_rate", "to_rate"), [(48000, 16000), (44100, 16000), (22050, 16000), (48000, 8000), (16000, 22050)]
)
def test_resampling_is_band_limited_and_within_tolerance_of_the_exact_signal(from_rate: int, to_rate: int) -> None:
    """Tones below 3/4 of both Nyquist frequencies come out as the exact tones sampled at the target
    rate, and as libswresample gave them, within RESAMPLE_TOLERANCE; tones above the target's
    Nyquist frequency (which linear interpolation would fold into the band) are gone (< -100 dB)."""
    seconds, nyquist = 2.0, min(from_rate, to_rate) / 2
    freqs = [0.1 * nyquist, 0.45 * nyquist, 0.74 * nyquist]
    got = media_audio.resample(_tones(seconds, from_rate, freqs).astype(np.float32), from_rate, to_rate)
    assert got.dtype == np.float32 and len(got) == round(seconds * to_rate)
    inner = slice(round(EDGE_S * to_rate), -round(EDGE_S * to_rate))
    exact = _tones(seconds, to_rate, freqs)
    assert np.abs(got[inner] - exact[inner]).max() < RESAMPLE_TOLERANCE
    before = _swr(_tones(seconds, from_rate, freqs).astype(np.float32), from_rate, to_rate)
    assert np.abs(got[inner] - before[inner]).max() < RESAMPLE_TOLERANCE
    if from_rate > to_rate:
        # Just above the output's Nyquist frequency (libswresample let most of it through), well
        # above it, and near the input's: benchmarks/resample_quality.py measures both resamplers.
        for f in (to_rate / 2 * 1.06, to_rate / 2 * 1.5, from_rate / 2 * 0.95):
            folded = media_audio.resample(_tones(seconds, from_rate, [f]).astype(np.float32), from_rate, to_rate)
            assert np.sqrt(np.mean(folded[inner] ** 2)) < 0.3 * 1e-5, f


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("from_rate", "to_rate"), [(48000, 16000), (44100, 16000), (22050, 16000), (48000, 22050)])
def test_resampling_in_pieces_equals_one_call(from_rate: int, to_rate: int) -> None:
    """The decoders feed the resampler as frames come: however the input is cut (single samples,
    odd sizes, more than RESAMPLE_CHUNK at once), the output is libsoxr's for one call, bit for bit,
    and as long as the input at the target rate, rounded."""
    signal = samples.chirp(7.0, from_rate)
    rng = np.random.default_rng(from_rate)
    converter = media_audio._RateConverter(from_rate, to_rate)
    begin = 0
    for size in [1, 1, 3, 1000, 3 * media_audio.RESAMPLE_CHUNK + 7, *rng.integers(1, 40_000, 40)]:
        converter.feed(signal[begin : begin + size])
        begin += size
    converter.feed(signal[begin:])
    whole = soxr.resample(signal, from_rate, to_rate, quality=media_audio.RESAMPLE_QUALITY)
    pieces = converter.result()
    assert len(pieces) == round(len(signal) * to_rate / from_rate)
    assert pieces.dtype == np.float32 and np.array_equal(pieces, whole)
    assert np.array_equal(media_audio.resample(signal, from_rate, to_rate), whole)


@pytest.mark.timeout(60)
def test_a_decode_gives_the_same_bits_in_another_process() -> None:
    """Ranks and resumed runs decode the same bytes in different processes: the outputs (resampled
    at 48 -> 16 kHz and 44.1 -> 22.05 kHz, windowed and whole) are the same bytes there."""
    data = samples.encode_av(container="mp4", audio=samples.chirp(3.0, 48000), sample_rate=48000)
    calls = [(0.0, None, 16000), (1.3, 1.0, 16000), (0.4, 2.0, 22050)]
    script = (
        "import hashlib, sys\n"
        "from resilient.trainer.data.media import decode_audio\n"
        "data = sys.stdin.buffer.read()\n"
        f"for start, duration, rate in {calls!r}:\n"
        "    out = decode_audio(data, 'm4a', start_s=start, duration_s=duration, sample_rate=rate)\n"
        "    print(hashlib.sha256(out.tobytes()).hexdigest())\n"
    )
    there = subprocess.run([sys.executable, "-c", script], input=data, capture_output=True, timeout=50, check=True)
    here = [
        hashlib.sha256(decode_audio(data, "m4a", start_s=s, duration_s=d, sample_rate=r).tobytes()).hexdigest()
        for s, d, r in calls
    ]
    assert there.stdout.decode().split() == here


def _frames(planes: np.ndarray, rate: int, first_pts: int, size: int = 1024) -> list[av.AudioFrame]:
    """[channels, n] float32 as decoder-like float-plane frames of ``size`` samples from ``first_pts``."""
    layout = "mono" if planes.shape[0] == 1 else "stereo"
    out = []
    for begin in range(0, planes.shape[1], size):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planes[:, begin : begin + size]), "fltp", layout)
        frame.sample_rate, frame.pts, frame.time_base = rate, first_pts + begin, Fraction(1, rate)
        out.append(frame)
    return out


class _Recorder:
    """Stands in for the rate converter: keeps what the timeline feeds it, piece by piece."""

    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []

    def feed(self, piece: np.ndarray | av.AudioFrame) -> None:
        self.pieces.append(piece.to_ndarray()[0] if isinstance(piece, av.AudioFrame) else piece)

    def result(self) -> np.ndarray:
        return np.concatenate(self.pieces) if self.pieces else np.zeros(0, dtype=np.float32)


def _laid(runs: list[tuple[int, np.ndarray]], first: int, last: int, cap: int | None) -> np.ndarray:
    """The expected span, in order of decoding: each run's mono mix at its position, zeros where no
    run was, and of a run that goes back in time only what lies past everything before it."""
    out = np.zeros(last - first, dtype=np.float32)
    fed = first
    for position, planes in runs:
        mono = planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
        lo, hi = max(position, fed), min(position + len(mono), last if cap is None else min(cap, last))
        if lo < hi:
            out[lo - first : hi - first] = mono[lo - position : hi - position]
            fed = hi
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize(
    ("positions", "length", "first", "last", "cap"),
    [
        ((0,), 5000, 0, 5000, None),  # one run, exactly the span
        ((0,), 5000, 999, 4100, 4100),  # cut inside frames at both ends (a window: its end is known)
        ((0,), 5000, 999, 4100, None),  # the same, its end known only at the end
        ((300,), 5000, 0, 6000, None),  # zeros before and after the run
        ((0, 9000), 5000, 500, 14000, None),  # a hole between two runs
        ((0, 120_000), 80_000, 1000, 190_000, 190_000),  # runs longer than RESAMPLE_CHUNK go a chunk at a time
        ((4000, 1000, 8000), 5000, 0, 13000, None),  # back in time: only what is past the decoded part counts
    ],
)
def test_timeline_lays_frames_by_their_timestamps(
    channels: int, positions: tuple[int, ...], length: int, first: int, last: int, cap: int | None
) -> None:
    rate = 48000
    rng = np.random.default_rng(len(positions) + first)
    runs = [(position, rng.uniform(-1, 1, (channels, length)).astype(np.float32)) for position in positions]
    recorder = _Recorder()
    timeline = media_audio._AudioTimeline(origin=0.0, rate=rate, first=first, cap=cap, out=recorder)
    for position, planes in runs:
        assert not timeline.lay([frame] for frame in _frames(planes, rate, position))
    assert timeline.end == max(position + length for position in positions)
    joined = timeline.finish(last)
    assert joined.dtype == np.float32
    # Fed up to the last decoded sample; what lies past it is left to the window's placement (zeros).
    decoded_to = min(max(position + length for position in positions), last if cap is None else min(cap, last))
    expected = _laid(runs, first, last, cap)
    assert len(joined) == max(decoded_to - first, 0)
    assert np.array_equal(joined, expected[: len(joined)]) and not expected[len(joined) :].any()
    if length > media_audio.RESAMPLE_CHUNK:
        decoded = [len(piece) for piece in recorder.pieces if np.any(piece)]
        assert len(decoded) >= 4 and max(decoded) <= media_audio.RESAMPLE_CHUNK


@pytest.mark.timeout(30)
@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_timeline_follows_a_change_of_channels_and_sample_format(order: tuple[int, int]) -> None:
    """Frames go to the FIFO as decoded while they are float planes at the native rate; a stream
    whose channel count changes mid-run (a new channel configuration) is mixed per frame all the
    same, and frames in another sample format (s16, as PCM and FLAC decode) are converted first."""
    rate, length = 48000, 5000
    rng = np.random.default_rng(7)
    runs = [rng.uniform(-1, 1, (channels, length)).astype(np.float32) for channels in order]
    recorder = _Recorder()
    timeline = media_audio._AudioTimeline(origin=0.0, rate=rate, first=0, cap=None, out=recorder)
    assert not timeline.lay([frame] for frame in _frames(runs[0], rate, 0))
    assert not timeline.lay([frame] for frame in _frames(runs[1], rate, length))
    expected = np.concatenate([_laid([(0, planes)], 0, length, None) for planes in runs])
    assert np.array_equal(timeline.finish(2 * length), expected)

    quantized = np.round(runs[1] * 32767).astype(np.int16)
    s16 = []
    for begin in range(0, length, 1024):
        piece = np.ascontiguousarray(quantized[:, begin : begin + 1024].T.reshape(1, -1))
        frame = av.AudioFrame.from_ndarray(piece, "s16", "mono" if order[1] == 1 else "stereo")
        frame.sample_rate, frame.pts, frame.time_base = rate, begin, Fraction(1, rate)
        s16.append(frame)
    recorder = _Recorder()
    timeline = media_audio._AudioTimeline(origin=0.0, rate=rate, first=0, cap=None, out=recorder)
    assert timeline.lay([frame] for frame in s16[:3]) is False and timeline.lay([s16[3:]], stop=3073) is True
    assert timeline.end == 4096  # it stops after the frame that reaches stop
    planes = quantized[:, :4096].astype(np.float32) / np.float32(32768)
    assert np.array_equal(timeline.finish(4096), _laid([(0, planes)], 0, 4096, None))


@pytest.mark.timeout(30)
def test_a_stream_with_more_packets_than_its_budget_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode stops with MediaError once a stream yields more packets than its budget (a broken
    file that keeps yielding), counted as the demuxer yields them, flush packets included; one that
    has exactly its budget decodes, and so does a window that ends within it."""
    data = samples.encode_av(container="mp4", audio=samples.chirp(1.0, 48000), sample_rate=48000)
    with av.open(io.BytesIO(data)) as c:
        count = sum(1 for _ in c.demux(c.streams.audio[0]))
    assert count > 40
    whole, window = decode_audio(data, "m4a"), decode_audio(data, "m4a", duration_s=0.4)
    monkeypatch.setattr(media_audio, "packet_budget", lambda data: count)
    assert np.array_equal(decode_audio(data, "m4a"), whole)
    monkeypatch.setattr(media_audio, "packet_budget", lambda data: count - 1)
    with pytest.raises(MediaError, match=f"gave up after {count - 1} packets: the stream does not end"):
        decode_audio(data, "m4a")
    monkeypatch.setattr(media_audio, "packet_budget", lambda data: 30)  # 30 AAC frames: 0.64 s
    assert np.array_equal(decode_audio(data, "m4a", duration_s=0.4), window)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_probe_options_leave_the_audio_as_a_plain_open_decodes_it(container: str) -> None:
    """The open of an audio decode tells the probe decoders to skip frames (an H.264 track costs more
    to probe than its AAC track to decode): audio decoders ignore it, and the frames, their
    timestamps and the stream's parameters are those of a plain open."""
    video = samples.ramp_frames(20, 32)
    data = samples.encode_av(container=container, video=video, fps=10, audio=samples.chirp(2.0, 48000))

    def decoded(options: dict[str, str]) -> tuple:
        with av.open(io.BytesIO(data), options=options) as c:
            stream = c.streams.audio[0]
            sample_format = stream.codec_context.format
            params = (stream.codec_context.sample_rate, sample_format and sample_format.name, stream.duration)
            frames = [(f.pts, f.to_ndarray()) for f in c.decode(stream)]
        return params, [pts for pts, _ in frames], np.concatenate([a for _, a in frames], axis=1)

    plain, probed = decoded({}), decoded(media_audio.PROBE_AUDIO_ONLY)
    assert plain[:2] == probed[:2]
    assert len(plain[1]) > 80
    assert np.array_equal(plain[2], probed[2])
    # Without probe decoders the headers give the same rate and length (the sample format is left
    # to the decoder), and the decoder the same frames.
    headers = decoded(media_audio.PROBE_HEADERS_ONLY)
    assert headers[0] == (plain[0][0], None, plain[0][2]) and headers[1] == plain[1]
    assert np.array_equal(plain[2], headers[2])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["header_rate_differs", "raw_adts"])
def test_an_open_whose_headers_disagree_with_the_decoder_is_probed_again(case: str) -> None:
    """The first open lets no probe decoder run (PROBE_HEADERS_ONLY). Where the headers' rate is not
    the decoder's (HE-AAC signalled implicitly; here a Matroska header rewritten to half the rate)
    or there is none (raw ADTS), the decode is that of the probed open, bit for bit."""
    if case == "raw_adts":
        ext, data = "aac", samples.encode_av(container="adts", audio=samples.chirp(2.0, 44100), sample_rate=44100)
    else:
        ext, written = "mkv", samples.encode_av(container="matroska", audio=samples.chirp(2.0, 48000))
        sampling_frequency = b"\xb5\x88" + struct.pack(">d", 48000.0)  # EBML element, an 8-byte float
        assert written.count(sampling_frequency) == 1
        data = written.replace(sampling_frequency, b"\xb5\x88" + struct.pack(">d", 24000.0))
    with av.open(io.BytesIO(data), options=media_audio.PROBE_HEADERS_ONLY) as c:
        assert c.streams.audio[0].codec_context.sample_rate == (0 if case == "raw_adts" else 24000)
    for start_s, duration_s in [(0.0, None), (0.7, 0.5)]:
        probed = media_audio._decode_audio_av(data, ext, start_s, duration_s, 16000, media_audio.PROBE_AUDIO_ONLY)
        assert len(probed) > 7000
        assert np.array_equal(decode_audio(data, ext, start_s=start_s, duration_s=duration_s), probed)
