"""Probe every candidate sample in parallel: which files it stores, which stream each holds, how
long it is, and its normalized text; or why it is skipped.

A thread pool, not a process pool: a probe spends its time inside FFmpeg (PyAV releases the GIL
around demuxing and decoding) and libsndfile (cffi releases it), so threads run in parallel
without pickling candidates or re-importing av in each worker, and without forking a process
that may already hold threads (tqdm's monitor, boto3's pools).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from resilient.trainer.data.shards.discover import Candidate, Skip
from resilient.trainer.data.shards.probe import MediaInfo, ProbeError, probe
from resilient.trainer.data.shards.text import TextError, empty_text, read_text_file

IN_FLIGHT_PER_WORKER = 4
"""Probes queued ahead per thread: keeps every thread busy without queueing the whole corpus."""
SAMPLE_TIMEOUT_S = 300.0
"""Longest wait for one sample's probe before it is skipped (a file on a hung network mount)."""


@dataclass(frozen=True, slots=True)
class ProbedSample:
    key: str
    files: tuple[tuple[str, str, int], ...]
    """(member extension, source path, size) of each stored media file: video file first."""
    video_ext: str | None
    audio_ext: str | None
    duration_s: float
    audio_s: float
    video_s: float
    text: dict
    """Normalized: {"text": str, "segments": [...]}."""


def _ext(path: str) -> str:
    return path.rpartition(".")[2].lower()


def probe_sample(c: Candidate) -> ProbedSample | Skip:
    """One candidate, probed; a Skip names the file at fault and why. Whatever one sample's files
    raise (a decoder's own error, a caption nested too deeply) skips that sample, never the build;
    MemoryError is not the sample's fault and is raised."""
    try:
        return _probe_sample(c)
    except MemoryError:
        raise
    except Exception as e:
        return Skip(c.origin, f"probe failed: {type(e).__name__}: {str(e)[:200]}")


def _probe_sample(c: Candidate) -> ProbedSample | Skip:
    infos: dict[str, MediaInfo] = {}
    for path in filter(None, (c.video_path, c.audio_path)):
        try:
            infos[path] = probe(path)
        except ProbeError as e:
            return Skip(path, str(e))
    try:
        text = c.text if c.text is not None else read_text_file(c.text_path) if c.text_path else empty_text()
    except TextError as e:
        return Skip(c.text_path or c.origin, str(e))
    try:
        return _roles(c, infos.get(c.video_path), infos.get(c.audio_path), text)
    except OSError as e:  # a file removed or made unreadable since it was probed
        return Skip(e.filename or c.origin, f"unreadable: {e.strerror or e}")


def _roles(c: Candidate, video: MediaInfo | None, audio: MediaInfo | None, text: dict) -> ProbedSample | Skip:
    """Which stored file gives the sample its video and its audio: a separate audio file wins over
    a video file's own soundtrack (it was given on purpose)."""
    video_ext = _ext(c.video_path) if video and video.has_video else None
    if audio and audio.has_audio:
        audio_ext, audio_s = _ext(c.audio_path), audio.duration_s
    elif video and video.has_audio:
        audio_ext, audio_s = _ext(c.video_path), video.duration_s
    else:
        audio_ext, audio_s = None, 0.0
    if video_ext is None and audio_ext is None:
        return Skip(c.origin, "no media: no file of this sample has a video or audio stream")
    files = tuple((_ext(p), p, os.path.getsize(p)) for p in (c.video_path, c.audio_path) if p)
    durations = [m.duration_s for m in (video, audio) if m]
    return ProbedSample(
        key=c.key,
        files=files,
        video_ext=video_ext,
        audio_ext=audio_ext,
        duration_s=max(durations),
        audio_s=audio_s,
        video_s=video.duration_s if video_ext else 0.0,
        text=text,
    )


def probe_all(candidates: list[Candidate], *, workers: int, progress: bool) -> tuple[list[ProbedSample], list[Skip]]:
    """Probe in ``workers`` threads; results in candidate order whatever order they finish in."""
    from tqdm import tqdm

    samples: list[ProbedSample] = []
    skipped: list[Skip] = []
    pool = _DaemonPool(workers)
    try:
        in_flight = _submitted_in_order(pool, candidates, window=IN_FLIGHT_PER_WORKER * workers)
        for c, future in tqdm(in_flight, total=len(candidates), desc="probe", unit="sample", disable=not progress):
            try:
                result = future.result(timeout=SAMPLE_TIMEOUT_S)
            except FutureTimeout:
                result = Skip(c.origin, f"probe did not finish within {SAMPLE_TIMEOUT_S:g} s")
            (skipped if isinstance(result, Skip) else samples).append(result)
    finally:
        pool.shutdown()  # a hung probe must not hold the build
    return samples, skipped


class _DaemonPool:
    """A thread pool whose threads are daemons: a probe hung in a read of a dead mount is skipped,
    and the process still exits (``ThreadPoolExecutor`` joins its threads at interpreter exit, so
    one hung probe kept a finished build from ever exiting)."""

    def __init__(self, workers: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"resilient-data-probe-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, which decides
                future.set_exception(e)

    def shutdown(self) -> None:
        """Stop the threads once their current probe returns; never waits for one."""
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for _ in self._threads:
            self._jobs.put(None)


def _submitted_in_order(pool: _DaemonPool, candidates: list[Candidate], window: int):
    """(candidate, future) in candidate order, with at most ``window`` submitted and not yet
    handed out: a million-file corpus does not become a million pending futures."""
    pending: deque = deque()
    for c in candidates:
        pending.append((c, pool.submit(probe_sample, c)))
        if len(pending) >= window:
            yield pending.popleft()
    while pending:
        yield pending.popleft()
