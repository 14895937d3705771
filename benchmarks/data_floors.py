"""The two floors data_bench sets each decode row against, measured in the same run as the row:

- raw PyAV: FFmpeg's decode of the same stream through PyAV, every frame handed out as an array,
  nothing else (no resampling, no placement, no resizing): what any PyAV-based decoder pays;
- torchcodec: the PyTorch project's decoder, run in a scratch environment of its own
  (``torchcodec_floor.py`` under ``--torchcodec-python``), where one can be installed.

And the quality yardstick of the video rows: each sampled frame against an exact area average of
the same frame converted to RGB at full resolution (mean absolute error, 0-1 scale).
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import av
import numpy as np


def raw_audio(data: bytes) -> None:
    """Every audio frame of the file decoded and copied out as an array, at its own rate and format."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        for frame in container.decode(stream):
            frame.to_ndarray()


def raw_video(data: bytes) -> None:
    """Every video frame decoded on one thread, left in the decoder's own pixel format."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        for _ in container.decode(stream):
            pass


class Torchcodec:
    """A torchcodec_floor.py process under another interpreter; ``available`` says whether it
    started, ``why_not`` why not."""

    def __init__(self, python: str | None, *, clock: str = "cpu") -> None:
        self.process: subprocess.Popen | None = None
        self.version, self.why_not = "", "no --torchcodec-python given"
        if not python:
            return
        script = Path(__file__).resolve().parent / "torchcodec_floor.py"
        try:
            self.process = subprocess.Popen(
                [python, str(script), clock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            answer = self._ask({"kind": "version"})
            self.version = f"torchcodec {answer['torchcodec']}, torch {answer['torch']}"
        except (OSError, ValueError, KeyError) as e:
            self.close()
            self.why_not = f"{python} could not run torchcodec: {e}"

    @property
    def available(self) -> bool:
        return self.process is not None

    def _ask(self, request: dict) -> dict:
        assert self.process is not None and self.process.stdin and self.process.stdout
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def audio(self, path: str, sample_rate: int, *, wav: bool = False) -> float:
        return self._ask({"kind": "audio", "path": path, "sample_rate": sample_rate, "wav": wav})["seconds"]

    def video(self, path: str, *, fps: int, size: int, frames: int, save: str | None = None) -> float:
        request = {"kind": "video", "path": path, "fps": fps, "size": size, "frames": frames, "save": save}
        return self._ask(request)["seconds"]

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()  # its loop ends at end of input
            self.process.wait(timeout=30)
            self.process = None


# ---------------------------------------------------------------------------------------------
# video quality


def area_reference(data: bytes, *, fps: int, size: int, frames: int) -> np.ndarray:
    """float [frames, size, size, 3]: the frame on screen at j / fps, converted to RGB at full
    resolution, then each output pixel the exact mean of the source area it covers."""
    shown: list[np.ndarray] = []
    with av.open(io.BytesIO(data)) as container:
        decoded = [(frame.time, frame.to_ndarray(format="rgb24")) for frame in container.decode(video=0)]
    for j in range(frames):
        instant = j / fps
        rgb = max((item for item in decoded if item[0] <= instant + 1e-9), key=lambda item: item[0])[1]
        rows, cols = _area_weights(rgb.shape[0], size), _area_weights(rgb.shape[1], size)
        planes = [rows @ rgb[..., channel].astype(np.float64) @ cols.T for channel in range(3)]
        shown.append(np.stack(planes, axis=-1) / 255.0)
    return np.stack(shown)


def _area_weights(source: int, target: int) -> np.ndarray:
    """[target, source]: row i averages source pixels over [i, i + 1) * source / target, partial
    pixels at the edges weighted by how much of them the area covers."""
    edges = np.arange(target + 1) * source / target
    left, right = np.arange(source), np.arange(source) + 1
    overlap = np.clip(np.minimum(edges[1:, None], right) - np.maximum(edges[:-1, None], left), 0, None)
    return overlap / overlap.sum(axis=1, keepdims=True)


def mean_abs_error(frames: np.ndarray, reference: np.ndarray) -> float:
    return float(np.mean(np.abs(frames.astype(np.float64) - reference)))
