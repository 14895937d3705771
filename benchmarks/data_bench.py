"""Data-pipeline throughput on ONE core: how fast ``resilient.trainer.data.media`` turns encoded
bytes into the arrays the tokenizer takes.

    .venv/bin/python benchmarks/data_bench.py            # 10 s clips, 3 repeats: ~10 s on a busy 2-core machine
    .venv/bin/python benchmarks/data_bench.py --quick    # 4 s clips, 1 repeat: ~5 s (noisier)

Then the loader rows (``data_loader_rows.py``; ``--no-loader`` leaves them out): rows/s of the
shard loader with 0, 1, 2 workers against the trainer's consumption at the media demo's settings.

Prints one JSON line per row, ``{"bench": "data", "name": ..., "value": ..., "unit": ...}``, the
median of ``--repeats`` timed runs after one untimed warm-up, then the issue's goals as ratio lines
(``unit: "ratio"``, > 1 means the goal is met): audio decodes at >= 50x realtime, video delivers
>= 200 frames/s. Everything is pinned to one core (torch and FFmpeg threads = 1): a data worker is
one process, and the trainer runs several.

The inputs are encoded by the bench itself into a temporary directory, from the same synthetic
signals the decoder tests use (tests/trainer/data/media_samples.py). Each row is one function
taking the inputs and the repeats and returning its JSON line; add a row by writing one and
listing it in ROWS (a loader row would read the same inputs through the shard loader).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The synthetic media generators live with the tests; the repository root makes them importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # data_loader_rows

from resilient.trainer.data.media import decode_audio, decode_video  # noqa: E402
from tests.trainer.data import media_samples  # noqa: E402

AUDIO_GOAL_REALTIME = 50.0
VIDEO_GOAL_FPS = 200.0
SOURCE_WIDTH, SOURCE_HEIGHT, SOURCE_FPS = 640, 360, 25


@dataclass(kw_only=True, slots=True)
class Inputs:
    """Encoded test media, read back from the temp dir as a shard member would be: bytes."""

    seconds: float
    """Length of every clip."""
    files: dict[str, bytes]
    """name -> encoded bytes: wav, flac, m4a, mp4_h264 (H.264 + AAC), mp4_mpeg4 (MPEG-4 Part 2)."""


def build_inputs(directory: str, seconds: float) -> Inputs:
    audio_48k = media_samples.chirp(seconds, 48000)
    audio_16k = media_samples.chirp(seconds, 16000)
    frames = media_samples.moving_frames(round(seconds * SOURCE_FPS), SOURCE_WIDTH, SOURCE_HEIGHT)
    encoded = {
        "wav": media_samples.encode_soundfile(audio_16k, 16000, "WAV"),
        "flac": media_samples.encode_soundfile(audio_16k, 16000, "FLAC"),
        "m4a": media_samples.encode_av(container="mp4", audio=audio_48k, sample_rate=48000),
        "mp4_h264": media_samples.encode_av(container="mp4", video=frames, fps=SOURCE_FPS, audio=audio_48k),
        "mp4_mpeg4": media_samples.encode_av(container="mp4", video=frames, video_codec="mpeg4", fps=SOURCE_FPS),
    }
    files = {}
    for name, data in encoded.items():
        path = os.path.join(directory, name)
        Path(path).write_bytes(data)
        files[name] = Path(path).read_bytes()
    return Inputs(seconds=seconds, files=files)


# ---------------------------------------------------------------------------------------------
# timing and lines


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one untimed warm-up (first-call costs: codec
    init, page faults in fresh buffers)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def line(name: str, value: float, unit: str) -> dict:
    return {"bench": "data", "name": name, "value": round(value, 2), "unit": unit}


# ---------------------------------------------------------------------------------------------
# rows: one function each, (inputs, repeats) -> JSON line


def _audio_row(name: str, inputs: Inputs, file: str, ext: str, repeats: int) -> dict:
    data = inputs.files[file]
    seconds = median_seconds(lambda: decode_audio(data, ext), repeats)
    return line(name, inputs.seconds / seconds, "x_realtime")


def audio_wav(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_wav_16k", inputs, "wav", "wav", repeats)


def audio_flac(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_flac_16k", inputs, "flac", "flac", repeats)


def audio_m4a(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_m4a_aac_48k", inputs, "m4a", "m4a", repeats)


def audio_mp4(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_mp4_aac_track_48k", inputs, "mp4_h264", "mp4", repeats)


def _video_row(name: str, inputs: Inputs, file: str, size: int, repeats: int) -> dict:
    data = inputs.files[file]
    frames = len(decode_video(data, "mp4", fps=2, size=size, threads=1))
    seconds = median_seconds(lambda: decode_video(data, "mp4", fps=2, size=size, threads=1), repeats)
    return line(name, frames / seconds, "frames_per_s")


def video_h264_16(inputs: Inputs, repeats: int) -> dict:
    return _video_row("video_h264_640x360_fps2_size16", inputs, "mp4_h264", 16, repeats)


def video_h264_64(inputs: Inputs, repeats: int) -> dict:
    return _video_row("video_h264_640x360_fps2_size64", inputs, "mp4_h264", 64, repeats)


def video_mpeg4_16(inputs: Inputs, repeats: int) -> dict:
    return _video_row("video_mpeg4_640x360_fps2_size16", inputs, "mp4_mpeg4", 16, repeats)


def video_mpeg4_64(inputs: Inputs, repeats: int) -> dict:
    return _video_row("video_mpeg4_640x360_fps2_size64", inputs, "mp4_mpeg4", 64, repeats)


ROWS: tuple[Callable[[Inputs, int], dict], ...] = (
    audio_wav,
    audio_flac,
    audio_m4a,
    audio_mp4,
    video_h264_16,
    video_h264_64,
    video_mpeg4_16,
    video_mpeg4_64,
)


def goal_lines(results: list[dict]) -> list[dict]:
    """Each result over the issue's goal for its unit: > 1 meets it."""
    goals = {"x_realtime": AUDIO_GOAL_REALTIME, "frames_per_s": VIDEO_GOAL_FPS}
    return [
        {
            "bench": "ratio",
            "name": f"{r['name']}_vs_goal_{goals[r['unit']]:g}",
            "value": round(r["value"] / goals[r["unit"]], 3),
            "unit": "ratio",
        }
        for r in results
        if r["unit"] in goals
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~4 s clips and 1 repeat: a ~10 s run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; lines report the median")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the generated clips")
    parser.add_argument("--no-loader", action="store_true", help="decode rows only (no shard build, no training)")
    args = parser.parse_args(argv)
    repeats, seconds = (1, 4.0) if args.quick else (args.repeats, args.seconds)
    if repeats < 1 or not 1.0 <= seconds <= 600.0:
        parser.error(f"--repeats must be >= 1 and --seconds in [1, 600], got {repeats}, {seconds}")

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="data_bench-") as directory:
        inputs = build_inputs(directory, seconds)
        results = []
        for row in ROWS:
            results.append(row(inputs, repeats))
            print(json.dumps(results[-1]), flush=True)
    for ratio in goal_lines(results):
        print(json.dumps(ratio), flush=True)
    if not args.no_loader:
        from data_loader_rows import loader_lines

        with tempfile.TemporaryDirectory(prefix="data_bench-loader-") as directory:
            for loader_line in loader_lines(directory, args.quick):
                print(json.dumps(loader_line), flush=True)


if __name__ == "__main__":
    main()
