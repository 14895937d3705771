"""Probe every candidate sample in parallel: which files it stores, which stream each holds, how
long it is, and its normalized text; or why it is skipped.

A thread pool, not a process pool: a probe spends its time inside FFmpeg (PyAV releases the GIL
around demuxing and decoding) and libsndfile (cffi releases it), so threads run in parallel
without pickling candidates or re-importing av in each worker, and without forking a process
that may already hold threads (tqdm's monitor, boto3's pools).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

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
    """One candidate, probed; a Skip names the file at fault and why."""
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
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resilient-data-probe")
    try:
        in_flight = _submitted_in_order(pool, candidates, window=IN_FLIGHT_PER_WORKER * workers)
        for c, future in tqdm(in_flight, total=len(candidates), desc="probe", unit="sample", disable=not progress):
            try:
                result = future.result(timeout=SAMPLE_TIMEOUT_S)
            except FutureTimeout:
                result = Skip(c.origin, f"probe did not finish within {SAMPLE_TIMEOUT_S:g} s")
            (skipped if isinstance(result, Skip) else samples).append(result)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a hung probe must not hold the build
    return samples, skipped


def _submitted_in_order(pool: ThreadPoolExecutor, candidates: list[Candidate], window: int):
    """(candidate, future) in candidate order, with at most ``window`` submitted and not yet
    handed out: a million-file corpus does not become a million pending futures."""
    pending: deque = deque()
    for c in candidates:
        pending.append((c, pool.submit(probe_sample, c)))
        if len(pending) >= window:
            yield pending.popleft()
    while pending:
        yield pending.popleft()
