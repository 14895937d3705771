"""media.py on real containers encoded here from known signals: pitch and length of decoded audio,
sample placement (a window equals the same span of a full decode, and both line up with the source),
which source frame each sampled video frame shows, and MediaError for every file that does not decode."""

from __future__ import annotations

import functools
import io
import math

import av
import numpy as np
import pytest

from resilient.trainer.data.media import MediaError, decode_audio, decode_video
from tests.trainer.data import media_samples as samples

RATE = 16000
SECONDS = 3.0
TONE_HZ = 1000.0
SOURCE_FPS = 10
VIDEO_FRAMES = 40  # 4 s at 10 fps

# ext -> (container or soundfile format, codec, the file's own sample rate). The rates differ from
# 16 kHz on purpose (except flac) so the resampler is on the tested path.
AUDIO_FILES = {
    "wav": ("WAV", None, 22050),
    "flac": ("FLAC", None, 16000),
    "ogg": ("OGG", None, 48000),
    "m4a": ("mp4", "aac", 48000),
    "mp3": ("mp3", "libmp3lame", 44100),
    "mp4": ("mp4", "aac", 48000),  # H.264 video + AAC audio
    "mkv": ("matroska", "aac", 48000),  # H.264 + AAC again, with millisecond timestamps
}
# Lossy codecs pad the end to a whole frame (1024 AAC samples at 48 kHz = 342 samples at 16 kHz).
# Where the container declares the audio's length (mp4's index) the padding is cut; A/V matroska
# declares none for its audio.
LENGTH_SLACK = {"wav": 0, "flac": 0, "ogg": 0, "m4a": 0, "mp3": 0, "mp4": 0, "mkv": 342}


@functools.cache
def _audio_file(ext: str, signal_kind: str) -> bytes:
    fmt, codec, rate = AUDIO_FILES[ext]
    signal = samples.tone(SECONDS, rate, TONE_HZ) if signal_kind == "tone" else samples.chirp(SECONDS, rate)
    if codec is None:
        return samples.encode_soundfile(signal, rate, fmt)
    video = samples.ramp_frames(30, 32) if ext in ("mp4", "mkv") else None
    return samples.encode_av(container=fmt, audio=signal, audio_codec=codec, sample_rate=rate, video=video, fps=10)


@functools.cache
def _video_file(codec: str) -> bytes:
    frames = samples.ramp_frames(VIDEO_FRAMES, 32)
    if codec == "libx264":  # the common case: H.264 with an AAC track beside it
        audio = samples.tone(VIDEO_FRAMES / SOURCE_FPS, 48000, TONE_HZ)
        return samples.encode_av(container="mp4", video=frames, fps=SOURCE_FPS, audio=audio)
    return samples.encode_av(container="mp4", video=frames, video_codec=codec, fps=SOURCE_FPS)


def _lag(decoded: np.ndarray, reference: np.ndarray, *, search: int = 40) -> int:
    """Samples by which ``decoded`` trails ``reference`` (0 = sample-aligned), from the middle second."""
    middle = decoded[RATE // 2 : RATE // 2 + RATE]
    window = reference[RATE // 2 - search : RATE // 2 + RATE + search]
    return search - int(np.argmax(np.correlate(window, middle, mode="valid")))


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", sorted(AUDIO_FILES))
def test_audio_length_and_pitch(ext: str) -> None:
    audio = decode_audio(_audio_file(ext, "tone"), ext)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - SECONDS * RATE) <= LENGTH_SLACK[ext]
    spectrum = np.abs(np.fft.rfft(audio[: int(SECONDS * RATE)]))
    peak_hz = np.argmax(spectrum) * RATE / int(SECONDS * RATE)
    assert abs(peak_hz - TONE_HZ) <= 1.0, f"{ext}: tone read back at {peak_hz} Hz"
    assert 0.3 < _rms(audio[RATE : 2 * RATE]) * np.sqrt(2) < 0.7  # amplitude 0.5 survives downmix and resampling


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", sorted(AUDIO_FILES))
def test_audio_is_placed_on_the_source_timeline(ext: str) -> None:
    """Full decode: the sample of instant t sits at round(t * 16000), AAC priming and MP3 delay included."""
    audio = decode_audio(_audio_file(ext, "chirp"), ext)
    reference = samples.chirp(SECONDS, RATE)
    assert _lag(audio, reference) == 0
    assert _rms(audio[RATE // 2 : 5 * RATE // 2] - reference[RATE // 2 : 5 * RATE // 2]) < 0.05


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", sorted(AUDIO_FILES))
@pytest.mark.parametrize(("start_s", "duration_s"), [(1.3, 1.0), (2.7, 0.3)])  # mid-file; the last page
def test_audio_window_matches_the_same_span_of_a_full_decode(ext: str, start_s: float, duration_s: float) -> None:
    data = _audio_file(ext, "chirp")
    full = decode_audio(data, ext)
    window = decode_audio(data, ext, start_s=start_s, duration_s=duration_s)
    assert window.shape == (round(duration_s * RATE),) and window.dtype == np.float32
    same_span = full[round(start_s * RATE) : round((start_s + duration_s) * RATE)]
    # Seeking re-primes a lossy decoder (AAC, Vorbis): the window is the same signal within codec
    # noise, far below the chirp's own level (rms 0.35), and not shifted by a single sample.
    assert _rms(window - same_span) < 0.02, f"{ext}: window differs from the full decode"
    shifted = full[round(start_s * RATE) - 1 : round((start_s + duration_s) * RATE) - 1]
    assert _rms(window - same_span) < _rms(window - shifted) / 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", sorted(AUDIO_FILES))
def test_audio_window_entirely_past_the_end(ext: str) -> None:
    data = _audio_file(ext, "chirp")
    assert decode_audio(data, ext, start_s=10.0).shape == (0,)
    padded = decode_audio(data, ext, start_s=10.0, duration_s=0.5)
    assert padded.shape == (8000,) and not padded.any()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", ["wav", "m4a", "mkv"])
def test_audio_window_past_the_end_is_zero_padded(ext: str) -> None:
    data = _audio_file(ext, "chirp")
    window = decode_audio(data, ext, start_s=2.5, duration_s=1.0)
    assert window.shape == (16000,)
    reference = samples.chirp(SECONDS, RATE)[40000:]
    assert _rms(window[400:7600] - reference[400:7600]) < 0.05
    assert np.abs(window[8400:]).max() == 0.0  # past the audio (and AAC's end padding): silence


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_video_frames_at_two_fps_show_their_source_instants(codec: str) -> None:
    video = decode_video(_video_file(codec), "mp4", fps=2, size=16)
    assert video.shape == (8, 16, 16, 3) and video.dtype == np.float32  # 4 s at 2 fps
    assert video.min() >= 0.0 and video.max() <= 1.0
    shown = [samples.ramp_index(frame) for frame in video]
    expected = [j * SOURCE_FPS // 2 for j in range(8)]
    assert all(abs(s - e) <= 1 for s, e in zip(shown, expected, strict=True)), (shown, expected)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_video_window_seeks_to_its_start(codec: str) -> None:
    start_s = 1.55
    video = decode_video(_video_file(codec), "mp4", fps=3, size=24, start_s=start_s, duration_s=1.0)
    assert video.shape == (3, 24, 24, 3)
    shown = [samples.ramp_index(frame) for frame in video]
    # The latest source frame at or before each instant: floor((start + j / fps) * 10) = 15, 18, 22.
    assert shown == [int((start_s + j / 3) * SOURCE_FPS) for j in range(3)]


@pytest.mark.timeout(30)
def test_video_stops_at_the_end_of_the_stream() -> None:
    video = decode_video(_video_file("libx264"), "mp4", fps=2, size=16, start_s=3.0, duration_s=5.0)
    # Instants 3.0 and 3.5 are inside the 4 s stream; 4.0 and later are not, and video is not padded.
    assert [samples.ramp_index(frame) for frame in video] == [30, 35]
    assert decode_video(_video_file("libx264"), "mp4", fps=2, size=16, start_s=10.0).shape == (0, 16, 16, 3)


@pytest.mark.timeout(30)
def test_video_frame_is_resized_by_area_average() -> None:
    """A 1-pixel checkerboard downscaled 32 -> 8 averages to mid-gray: point sampling would keep
    only black or only white pixels."""
    board = (np.indices((32, 32)).sum(axis=0) % 2 * 255).astype(np.uint8)
    frames = np.repeat(np.repeat(board[None, :, :, None], 3, axis=3), 4, axis=0)
    data = samples.encode_av(container="mp4", video=frames, video_codec="mpeg4", fps=4)
    video = decode_video(data, "mp4", fps=4, size=8)
    assert video.shape == (4, 8, 8, 3)
    assert np.abs(video - 0.5).max() < 0.15


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", sorted(AUDIO_FILES))
def test_truncated_or_garbage_audio_raises_media_error(ext: str) -> None:
    data = _audio_file(ext, "tone")
    with pytest.raises(MediaError, match=rf"\.{ext}"):
        decode_audio(b"\x00\x01garbage" * 64, ext)
    with pytest.raises(MediaError, match=rf"\.{ext}"):
        decode_audio(data[:40], ext)  # cut inside the header


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", ["wav", "flac", "m4a", "mp3", "mp4"])
def test_audio_cut_mid_stream_raises_media_error(ext: str) -> None:
    """A partial download: the header is intact, the samples stop at 60%. (Ogg Vorbis and A/V
    matroska declare no audio length to compare with: they decode what is there.)"""
    data = _audio_file(ext, "tone")
    with pytest.raises(MediaError, match=rf"\.{ext}"):
        decode_audio(data[: len(data) * 6 // 10], ext)


@pytest.mark.timeout(30)
def test_truncated_or_garbage_video_raises_media_error() -> None:
    data = _video_file("libx264")
    for broken in (b"", b"\x00" * 1000, np.random.default_rng(0).bytes(4096), data[: len(data) // 2]):
        with pytest.raises(MediaError, match=r"\.mp4"):
            decode_video(broken, "mp4", fps=2, size=16)


@pytest.mark.timeout(30)
def test_faststart_mp4_cut_short_raises_media_error() -> None:
    """With the index up front a cut file still opens and demuxes; its packets just stop early."""
    frames, audio = samples.ramp_frames(40, 32), samples.tone(4.0, 48000, TONE_HZ)
    data = samples.encode_av(container="mp4", video=frames, fps=SOURCE_FPS, audio=audio, faststart=True)
    assert decode_video(data, "mp4", fps=2, size=16).shape == (8, 16, 16, 3)
    cut = data[: len(data) * 8 // 10]
    with pytest.raises(MediaError, match="truncated"):
        decode_video(cut, "mp4", fps=2, size=16)
    with pytest.raises(MediaError, match=r"\.mp4"):
        decode_audio(cut, "mp4")


@pytest.mark.timeout(30)
def test_missing_stream_or_unknown_ext_raises_media_error() -> None:
    with pytest.raises(MediaError, match="no audio stream"):
        decode_audio(_video_file("mpeg4"), "mp4")
    with pytest.raises(MediaError, match="no video stream"):
        decode_video(_audio_file("m4a", "tone"), "mp4", fps=2, size=16)
    with pytest.raises(MediaError, match="unknown extension"):
        decode_audio(_audio_file("wav", "tone"), "xyz")
    with pytest.raises(MediaError, match="unknown extension"):
        decode_video(_video_file("mpeg4"), "wav", fps=2, size=16)


@pytest.mark.timeout(30)
def test_video_sampling_equals_a_decode_of_every_frame() -> None:
    """Skipped non-reference frames never change the answer: for many windows and rates, each
    sampled frame is the latest frame with pts <= its instant among ALL frames (brute force)."""
    data = samples.encode_av(container="mp4", video=samples.ramp_frames(48, 16), fps=12)  # x264, B-frames
    with av.open(io.BytesIO(data)) as container:
        every = [
            (frame.time, samples.ramp_index(frame.to_ndarray(format="rgb24") / 255.0))
            for frame in container.decode(video=0)
        ]
    for start_s in (0.0, 0.37, 1.0, 2.9):
        for fps in (1, 2, 5, 7):
            video = decode_video(data, "mp4", fps=fps, size=8, start_s=start_s, duration_s=1.3)
            shown = [samples.ramp_index(frame) for frame in video]
            instants = [start_s + j / fps for j in range(len(shown))]
            assert shown == [max(i for t, i in every if t <= instant + 1e-9) for instant in instants]
            assert len(shown) == min(math.ceil(1.3 * fps), math.ceil((4.0 - start_s) * fps))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("threads", [0, 1])  # frame threads hold frames back; one thread does not
def test_video_jumping_to_keyframes_equals_decoding_every_frame(threads: int) -> None:
    """MPEG-4 Part 2 without B-frames (a keyframe every 12 frames, P-frames between): sampled
    sparsely, decoding jumps from frame to a later keyframe; every sampled frame is still, pixel for
    pixel, the one a decode of every frame shows at its instant."""
    data = samples.encode_av(container="mp4", video=samples.moving_frames(48, 64, 48), video_codec="mpeg4", fps=12)
    with av.open(io.BytesIO(data)) as container:
        keyframes = [packet.is_keyframe for packet in container.demux(video=0) if packet.size]
    assert sum(keyframes) == 4 and len(keyframes) == 48  # P-frames between keyframes: jumps are real
    every = decode_video(data, "mp4", fps=12, size=8)  # a target per source frame: nothing is left out
    assert every.shape == (48, 8, 8, 3) and len({frame.tobytes() for frame in every}) == 48
    for start_s in (0.0, 0.37, 1.0, 2.9):
        for fps in (1, 2, 5, 7):
            video = decode_video(data, "mp4", fps=fps, size=8, start_s=start_s, duration_s=1.3, threads=threads)
            instants = [start_s + j / fps for j in range(len(video))]
            expected = every[[math.floor(instant * 12 + 1e-9) for instant in instants]]
            assert np.array_equal(video, expected), (start_s, fps)


@pytest.mark.timeout(30)
def test_video_frame_is_the_area_average_of_the_full_size_rgb_frame() -> None:
    """Each output pixel is the mean of the source pixels it covers, taken over the frame converted
    to RGB at full size: within a few 8-bit steps of that exact average (a one-step convert and
    resize of 4:2:0 video averages subsampled chroma and lands several times further away)."""
    data = samples.encode_av(container="mp4", video=samples.moving_frames(4, 64, 48), video_codec="mpeg4", fps=4)
    with av.open(io.BytesIO(data)) as container:
        full = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]) / 255.0
    reference = full.reshape(4, 8, 6, 8, 8, 3).mean(axis=(2, 4))  # 48x64 -> 8x8: blocks of 6x8 pixels
    video = decode_video(data, "mp4", fps=4, size=8)
    assert video.shape == reference.shape
    assert float(np.mean(np.abs(video - reference))) < 0.004
