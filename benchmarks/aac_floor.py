"""Where the floor of a PyAV decode of AAC lies: our ``decode_audio`` against the same decode with
parts of it taken away, each alone in this process, and torchcodec's whole decode alone in its own
(benchmarks/README.md, "AAC and MPEG-4, fifth look").

    .venv/bin/python benchmarks/aac_floor.py [--seconds 10] [--rounds 41] [--torchcodec-python /tmp/tcvenv/bin/python]

One 48 kHz mono AAC clip in M4A (data_bench's), decoded to 16 kHz mono. The variants run in turn
in this process, round by round (A B C ... A B C ...), CPU time; one JSON line each with the
median in ms. The bare loops feed on at our FIFO's drain threshold, as ours does:

- ``ours``: ``decode_audio``;
- ``ours_no_resampler``: the same with a resampler that only counts what it is fed (what our own
  placement, checks and window cost is ``ours_no_resampler`` - ``bare_fifo``);
- ``bare_decode``: open (headers only, as ours) + demux + decode, nothing done with the frames;
- ``bare_fifo``: the same, every frame written to an FFmpeg FIFO and read back in 28k pieces;
- ``bare_fifo_soxr``: the same, the pieces resampled by libsoxr as ours does (none of our code);
- ``bare_fifo_converter``: the same through our rate converter (``_RateConverter``: libsoxr, its
  output written into one array), so ``ours`` - this is what our placement, checks and window cost;
- ``soxr_alone``: libsoxr on as many samples of noise, in the same pieces;
- ``torchcodec`` (with ``--torchcodec-python``): its whole decode to 16 kHz mono, ``--rounds``
  times in a row in its own process (``torchcodec_floor.py``), after one untimed call.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.trainer.data.media_samples
sys.path.insert(0, str(Path(__file__).resolve().parent))  # data_floors

import av  # noqa: E402
import data_floors  # noqa: E402
import numpy as np  # noqa: E402
import soxr  # noqa: E402

from resilient.trainer.data import media_audio  # noqa: E402
from resilient.trainer.data.media import decode_audio  # noqa: E402
from tests.trainer.data import media_samples  # noqa: E402

PIECE = media_audio.RESAMPLE_CHUNK - 4096  # what our FIFO feeds on at


class _CountingResampler:
    """Stands in for ``media_audio._RateConverter``: takes what it is fed, resamples nothing."""

    def __init__(self, from_rate: int, to_rate: int, *, expected: int | None = None) -> None:
        self.fed, self.ratio = 0, to_rate / from_rate

    def feed(self, samples: np.ndarray) -> None:
        self.fed += len(samples)

    def result(self) -> np.ndarray:
        return np.zeros(round(self.fed * self.ratio), dtype=np.float32)


def variants(data: bytes, native: int, seconds: float) -> dict[str, Callable[[], object]]:
    def ours_no_resampler() -> None:
        real = media_audio._RateConverter
        media_audio._RateConverter = _CountingResampler
        try:
            decode_audio(data, "m4a")
        finally:
            media_audio._RateConverter = real

    def bare(fifo: bool, feed: Callable[[np.ndarray], object] | None = None) -> None:
        with av.open(io.BytesIO(data), options=media_audio.PROBE_HEADERS_ONLY) as container:
            stream = container.streams.audio[0]
            decoded = map(stream.codec_context.decode, container.demux(stream))
            if not fifo:
                collections.deque(decoded, 0)
                return
            queue = av.AudioFifo()
            for frames in decoded:
                for frame in frames:
                    frame.pts = None
                    queue.write(frame)
                    if queue.samples >= PIECE:
                        _drain(queue, feed)
            _drain(queue, feed)

    def bare_soxr() -> None:
        resampler = soxr.ResampleStream(native, 16000, 1, dtype="float32", quality=media_audio.RESAMPLE_QUALITY)
        bare(True, resampler.resample_chunk)
        resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)

    def bare_converter() -> None:
        converter = media_audio._RateConverter(native, 16000, expected=round(native * seconds))
        bare(True, converter.feed)
        converter.result()

    noise = np.random.default_rng(0).standard_normal(round(native * seconds)).astype(np.float32)

    def soxr_alone() -> None:
        resampler = soxr.ResampleStream(native, 16000, 1, dtype="float32", quality=media_audio.RESAMPLE_QUALITY)
        for begin in range(0, len(noise), PIECE):
            resampler.resample_chunk(noise[begin : begin + PIECE])
        resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)

    return {
        "ours": lambda: decode_audio(data, "m4a"),
        "ours_no_resampler": ours_no_resampler,
        "bare_decode": lambda: bare(False),
        "bare_fifo": lambda: bare(True),
        "bare_fifo_soxr": bare_soxr,
        "bare_fifo_converter": bare_converter,
        "soxr_alone": soxr_alone,
    }


def _drain(queue: av.AudioFifo, feed: Callable[[np.ndarray], object] | None) -> None:
    while queue.samples:
        piece = queue.read(min(media_audio.RESAMPLE_CHUNK, queue.samples))
        if feed is not None:
            feed(np.frombuffer(piece.planes[0], np.float32, piece.samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the clip")
    parser.add_argument("--rounds", type=int, default=41, help="timed rounds of every variant")
    parser.add_argument("--torchcodec-python", help="an interpreter with torchcodec (benchmarks/README.md)")
    args = parser.parse_args()
    native = 48000
    data = media_samples.encode_av(container="mp4", audio=media_samples.chirp(args.seconds, native), sample_rate=native)
    runs = variants(data, native, args.seconds)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_number in range(args.rounds + 1):
        for name, run in runs.items():
            start = time.process_time()
            run()
            if round_number:
                times[name].append(time.process_time() - start)
    for name, spent in times.items():
        print(json.dumps(_line(name, spent)))
    if args.torchcodec_python:
        print(json.dumps(_torchcodec_alone(args.torchcodec_python, data, args.rounds)))


def _torchcodec_alone(python: str, data: bytes, rounds: int) -> dict:
    floor = data_floors.Torchcodec(python)
    if not floor.available:
        return {"bench": "aac_floor", "name": "torchcodec", "value": None, "why_not": floor.why_not}
    with tempfile.NamedTemporaryFile(suffix=".m4a") as f:
        f.write(data)
        f.flush()
        floor.audio(f.name, 16000)
        spent = [floor.audio(f.name, 16000) for _ in range(rounds)]
    floor.close()
    return {**_line("torchcodec", spent), "version": floor.version}


def _line(name: str, spent: list[float]) -> dict:
    return {"bench": "aac_floor", "name": name, "value": round(statistics.median(spent) * 1e3, 3), "unit": "cpu_ms"}


if __name__ == "__main__":
    main()
