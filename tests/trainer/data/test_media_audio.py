"""media_audio and media_wav below the face: the direct WAV read returns libsndfile's values bit for
bit, and the resampler's output does not depend on how its input is cut into calls."""

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
