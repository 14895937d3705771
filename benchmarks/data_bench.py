"""Data-pipeline throughput on ONE core: how fast ``resilient.trainer.data.media`` turns encoded
bytes into the arrays the tokenizer takes, against two floors measured in the same run.

    .venv/bin/python benchmarks/data_bench.py            # 10 s clips, 3 repeats
    .venv/bin/python benchmarks/data_bench.py --quick    # 4 s clips, 1 repeat (noisier)
    .venv/bin/python benchmarks/data_bench.py --no-loader --repeats 7 --torchcodec-python /tmp/tcvenv/bin/python

Then the loader rows (``data_loader_rows.py``; ``--no-loader`` leaves them out): rows/s of the
shard loader with 0, 1, 2 workers against the trainer's consumption at the media demo's settings.

Prints one JSON line per row, ``{"bench": "data", "name": ..., "value": ..., "unit": ...}``, the
median of ``--repeats`` timed runs after one untimed round, with ``seconds`` (ours) and, per floor,
``<floor>_s`` and ``x_<floor>`` = ours / floor (<= 1.0: at least as fast): ``raw_pyav`` is PyAV's
decode of the same stream with nothing after it, ``torchcodec`` the PyTorch project's decoder,
run under ``--torchcodec-python`` (an interpreter outside this project's dependencies; the first
line, ``floors``, says which were measured). Ours and the floors run in turn, round by round
(data_floors.py). Video rows add ``mae_vs_full_res`` (and torchcodec's): mean absolute error of
the frames against an exact area average of the frame converted to RGB at full size, 0-1 scale.
Times are CPU time of the timed process by default (``--clock wall`` for the wall clock): on a
shared machine a single-threaded decode's wall time mostly measures its wait for a core. Then the
issue's goals as ratio lines (``unit: "ratio"``, > 1 means the goal is met): audio decodes at
>= 50x realtime, video delivers >= 200 frames/s. Everything is pinned to one thread (torch and
FFmpeg threads = 1, torchcodec too): a data worker is one process, and the trainer runs several.

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

import data_floors  # noqa: E402
import numpy as np  # noqa: E402

from resilient.trainer.data.media import decode_audio, decode_video  # noqa: E402
from tests.trainer.data import media_samples  # noqa: E402

# This process's CPU time by default: on a shared machine the wall clock of a single-threaded
# decode mostly measures how long it waited for a core (--clock wall to time the wall anyway).
CLOCK: Callable[[], float] = time.process_time
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
    paths: dict[str, str]
    """name -> the same bytes on disk (for the torchcodec process)."""
    directory: str
    torchcodec: data_floors.Torchcodec


def build_inputs(directory: str, seconds: float, torchcodec: data_floors.Torchcodec) -> Inputs:
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
    files, paths = {}, {}
    for name, data in encoded.items():
        paths[name] = os.path.join(directory, name)
        Path(paths[name]).write_bytes(data)
        files[name] = Path(paths[name]).read_bytes()
    return Inputs(seconds=seconds, files=files, paths=paths, directory=directory, torchcodec=torchcodec)


# ---------------------------------------------------------------------------------------------
# timing and lines


def alternating(runs: dict[str, Callable[[], float | None]], repeats: int) -> dict[str, list[float]]:
    """Each run ``repeats`` times, in turn (A B C A B C ...), after one untimed round: a drift in
    the machine's speed then moves all of them alike. A run returning a number reports its own
    time (torchcodec, timed in its own process); otherwise CLOCK's time around it counts."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_number in range(repeats + 1):
        for name, run in runs.items():
            start = CLOCK()
            own = run()
            if round_number:
                times[name].append(own if isinstance(own, float) else CLOCK() - start)
    return times


def line(name: str, value: float, unit: str, **fields: object) -> dict:
    return {"bench": "data", "name": name, "value": round(value, 2), "unit": unit, **fields}


def floor_fields(times: dict[str, list[float]]) -> dict:
    """Our median time against each floor measured in the same rounds: ``x_<floor>`` = ours /
    floor (<= 1.0: at least as fast)."""
    ours = statistics.median(times["ours"])
    fields: dict[str, object] = {"seconds": round(ours, 5)}
    for floor in ("raw_pyav", "torchcodec"):
        if floor in times:
            fields[f"{floor}_s"] = round(statistics.median(times[floor]), 5)
            fields[f"x_{floor}"] = round(ours / statistics.median(times[floor]), 3)
    return fields


# ---------------------------------------------------------------------------------------------
# rows: one function each, (inputs, repeats) -> JSON line


def _audio_row(name: str, inputs: Inputs, file: str, ext: str, repeats: int) -> dict:
    data = inputs.files[file]
    runs: dict[str, Callable[[], float | None]] = {
        "ours": lambda: decode_audio(data, ext),
        "raw_pyav": lambda: data_floors.raw_audio(data),
    }
    if inputs.torchcodec.available:
        runs["torchcodec"] = lambda: inputs.torchcodec.audio(inputs.paths[file], 16000, wav=ext == "wav")
    times = alternating(runs, repeats)
    return line(name, inputs.seconds / statistics.median(times["ours"]), "x_realtime", **floor_fields(times))


def audio_wav(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_wav_16k", inputs, "wav", "wav", repeats)


def audio_flac(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_flac_16k", inputs, "flac", "flac", repeats)


def audio_m4a(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_m4a_aac_48k", inputs, "m4a", "m4a", repeats)


def audio_mp4(inputs: Inputs, repeats: int) -> dict:
    return _audio_row("audio_mp4_aac_track_48k", inputs, "mp4_h264", "mp4", repeats)


def _video_row(name: str, inputs: Inputs, file: str, size: int, repeats: int) -> dict:
    data, fps = inputs.files[file], 2
    ours = decode_video(data, "mp4", fps=fps, size=size, threads=1)
    runs: dict[str, Callable[[], float | None]] = {
        "ours": lambda: decode_video(data, "mp4", fps=fps, size=size, threads=1),
        "raw_pyav": lambda: data_floors.raw_video(data),
    }
    reference = data_floors.area_reference(data, fps=fps, size=size, frames=len(ours))
    quality = {"mae_vs_full_res": round(data_floors.mean_abs_error(ours, reference), 4)}
    if inputs.torchcodec.available:
        path, saved = inputs.paths[file], os.path.join(inputs.directory, f"{name}.npy")
        inputs.torchcodec.video(path, fps=fps, size=size, frames=len(ours), save=saved)
        quality["torchcodec_mae_vs_full_res"] = round(data_floors.mean_abs_error(np.load(saved), reference), 4)
        runs["torchcodec"] = lambda: inputs.torchcodec.video(path, fps=fps, size=size, frames=len(ours))
    times = alternating(runs, repeats)
    return line(name, len(ours) / statistics.median(times["ours"]), "frames_per_s", **floor_fields(times), **quality)


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
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="time each run's CPU time (default) or wall time"
    )
    parser.add_argument("--only", default="", help="run only the rows whose name contains this (e.g. audio)")
    parser.add_argument(
        "--torchcodec-python",
        default=os.environ.get("TORCHCODEC_PYTHON"),
        help="an interpreter with torchcodec installed (outside this project): adds its floor to every row",
    )
    args = parser.parse_args(argv)
    repeats, seconds = (1, 4.0) if args.quick else (args.repeats, args.seconds)
    if repeats < 1 or not 1.0 <= seconds <= 600.0:
        parser.error(f"--repeats must be >= 1 and --seconds in [1, 600], got {repeats}, {seconds}")

    import av
    import torch

    torch.set_num_threads(1)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torchcodec = data_floors.Torchcodec(args.torchcodec_python, clock=args.clock)
    floors = {"clock": args.clock, "raw_pyav": f"PyAV {av.__version__}, FFmpeg {av.ffmpeg_version_info}"}
    floors["torchcodec"] = torchcodec.version if torchcodec.available else f"not measured: {torchcodec.why_not}"
    print(json.dumps({"bench": "data", "name": "floors", **floors}), flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="data_bench-") as directory:
            inputs = build_inputs(directory, seconds, torchcodec)
            results = []
            for row in (row for row in ROWS if args.only in row.__name__):
                results.append(row(inputs, repeats))
                print(json.dumps(results[-1]), flush=True)
    finally:
        torchcodec.close()
    for ratio in goal_lines(results):
        print(json.dumps(ratio), flush=True)
    if not args.no_loader:
        from data_loader_rows import loader_lines

        with tempfile.TemporaryDirectory(prefix="data_bench-loader-") as directory:
            for loader_line in loader_lines(directory, args.quick):
                print(json.dumps(loader_line), flush=True)


if __name__ == "__main__":
    main()
