"""media_audio and media_wav below the face: the direct WAV read returns libsndfile's values bit for
bit, the resampler's output does not depend on how its input is cut into calls, decoded frames are
laid onto the native timeline by their timestamps (holes zero; a run that goes back in time adds
only what lies past the decoded part), and the options that spare the open from probing video leave
the audio untouched."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile

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


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("from_rate", "seconds"), [(48000, 7.0), (44100, 4.7), (22050, 9.1)])
def test_resampling_in_pieces_equals_one_call(from_rate: int, seconds: float) -> None:
    """The resampler is fed in pieces (much faster than one call with a whole clip): its output
    must be the one a single call gives, bit for bit, across several piece boundaries."""
    signal = samples.chirp(seconds, from_rate)
    assert len(signal) > 3 * media_audio.RESAMPLE_CHUNK
    resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
    frame = av.AudioFrame.from_ndarray(signal[None, :], format="flt", layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = from_rate, 0, Fraction(1, from_rate)
    whole = np.concatenate([f.to_ndarray().reshape(-1) for f in resampler.resample(frame) + resampler.resample(None)])
    pieces = media_audio.resample(signal, from_rate, 16000)
    assert len(pieces) == round(seconds * 16000)
    assert np.array_equal(pieces, whole)


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
        for frame in _frames(planes, rate, position):
            timeline.add(frame)
    assert timeline.end == max(position + length for position in positions)
    joined = timeline.finish(last)
    assert joined.dtype == np.float32
    assert np.array_equal(joined, _laid(runs, first, last, cap))
    if length > media_audio.RESAMPLE_CHUNK:
        decoded = [len(piece) for piece in recorder.pieces if np.any(piece)]
        assert len(decoded) >= 4 and max(decoded) <= media_audio.RESAMPLE_CHUNK


@pytest.mark.timeout(30)
def test_rate_conversion_fed_piece_by_piece_equals_one_array() -> None:
    """The timeline feeds the converter as frames arrive: pieces of any size, FIFO frames and arrays
    mixed, give the samples the whole array gives."""
    signal = samples.chirp(3.0, 44100)
    converter = media_audio._RateConverter(44100, 16000)
    for begin, end in [(0, 1000), (1000, 1001), (1001, 50_000), (50_000, len(signal))]:
        piece = signal[begin:end]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(piece[None, :]), format="fltp", layout="mono")
        converter.feed(frame if begin % 2 else piece)
    assert np.array_equal(converter.result(), media_audio.resample(signal, 44100, 16000))
    assert len(media_audio.resample(signal, 44100, 16000)) == round(3.0 * 16000)


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
            params = (stream.codec_context.sample_rate, stream.codec_context.format.name, stream.duration)
            frames = [(f.pts, f.to_ndarray()) for f in c.decode(stream)]
        return params, [pts for pts, _ in frames], np.concatenate([a for _, a in frames], axis=1)

    plain, probed = decoded({}), decoded(media_audio.PROBE_AUDIO_ONLY)
    assert plain[:2] == probed[:2]
    assert len(plain[1]) > 80
    assert np.array_equal(plain[2], probed[2])
