"""Retention's requests per commit with every step kept: a pass that looks at every committed step
(the code before 2026-12-07, and still what a new process's first pass does) against the pass that
skips the steps earlier passes of the process settled (``storage/retention_cache.py``).

A root holding ``--kept`` committed steps (each a manifest and one small object in its attempt) is
built untimed; then each of ``--commits`` rounds commits one more step and runs the retention a
commit runs (``keep_last`` unset, in-flight attempts of the last ``young_s`` spared), counting the
requests of that retention alone: on S3 every API call of the store's clients (a paged LIST counts
once a page), on disk every object-store call (a read, a stat, a directory listing). The settled
case starts after one full pass, as a run's steady state does.

    python benchmarks/bench_retention.py [--s3] [--kept 20,100] [--commits 5]

Also run by ``ckpt_bench.py --objects`` (disk) and ``--objects --s3`` (loopback moto).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

from bench_common import emit

log = logging.getLogger("ckpt_bench.retention")
YOUNG_S = 60.0
IMPLS = ("every_step_looked_at", "resilient")


class _CountingStore:
    """The object store with every call counted (the disk's requests: each is a syscall or more)."""

    _COUNTED = ("read", "write", "write_if_absent", "exists", "list_children", "list_keys", "delete_prefix")

    def __init__(self, store) -> None:
        self._store, self.calls = store, 0

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if name not in self._COUNTED:
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def _open(url: str):
    """A store and a function giving how many requests it has made so far."""
    from resilient.storage.objects import open_store
    from resilient.storage.url import parse_url

    store = open_store(parse_url(url))
    if url.startswith("s3://"):
        counts = {"calls": 0}

        def count(**_kwargs) -> None:
            counts["calls"] += 1

        for client in (store._client, store._commit_client):
            client.meta.events.register("before-call.s3", count)
        return store, lambda: counts["calls"]
    counting = _CountingStore(store)
    return counting, lambda: counting.calls


def _commit(store, step: int) -> None:
    from resilient.manifest import Manifest, step_dir
    from resilient.storage.commit import commit_manifest
    from resilient.storage.retention import new_attempt

    attempt = new_attempt()
    store.write(f"{step_dir(step)}/{attempt}/w/c/0", b"x" * 64)
    commit_manifest(store, Manifest(step=step, attempt=attempt, world_size=1, arrays={}, values={}))


def measure(url: str, kept: int, commits: int, impl: str) -> dict:
    """Median requests and seconds of one commit's retention, ``kept`` steps already committed."""
    from resilient.storage.retention import KeepLast, apply_retention
    from resilient.storage.retention_cache import CheckedSteps

    store, requests = _open(url)
    for step in range(1, kept + 1):
        _commit(store, step)
    known = CheckedSteps() if impl == "resilient" else None
    apply_retention(store, KeepLast(None), young_s=YOUNG_S, known=known)  # a run's first pass: untimed
    counts, seconds = [], []
    for step in range(kept + 1, kept + 1 + commits):
        _commit(store, step)
        before, started = requests(), time.perf_counter()
        apply_retention(store, KeepLast(None), young_s=YOUNG_S, known=known)
        seconds.append(time.perf_counter() - started)
        counts.append(requests() - before)
    return {"requests": statistics.median(counts), "seconds": round(statistics.median(seconds), 4)}


def run_retention(kept_steps: list[int], commits: int, *, s3: bool, root: str | None = None) -> None:
    """Emit one line per (kept steps, impl) and the ratio; S3 needs AWS_ENDPOINT_URL (moto)."""
    scratch = root or tempfile.mkdtemp(prefix="bench-retention-")
    bucket = None
    if s3:
        import boto3

        bucket = f"retention-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(
            Bucket=bucket
        )
    try:
        for kept in kept_steps:
            lines = {}
            for impl in IMPLS:
                url = f"s3://{bucket}/{impl}-{kept}" if s3 else os.path.join(scratch, f"{impl}-{kept}")
                result = measure(url, kept, commits, impl)
                lines[impl] = {
                    "bench": "retention_requests_per_commit",
                    "store": "s3" if s3 else "file",
                    "impl": impl,
                    "kept_steps": kept,
                    "commits": commits,
                    **result,
                }
                emit(lines[impl])
            ratio = lines["resilient"]["requests"] / lines["every_step_looked_at"]["requests"]
            name = f"retention_requests_{'s3' if s3 else 'file'}_{kept}_resilient_over_every_step_looked_at"
            emit({"bench": "ratio", "name": name, "value": round(ratio, 3)})
    finally:
        if root is None:
            shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--s3", action="store_true", help="against a loopback moto server instead of the disk")
    parser.add_argument("--kept", default="20,100", help="committed steps already kept")
    parser.add_argument("--commits", type=int, default=5, help="measured commits (the median is reported)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    kept = [int(n) for n in args.kept.split(",")]
    if args.s3:
        from bench_s3 import moto_server

        with moto_server():
            run_retention(kept, args.commits, s3=True)
    else:
        run_retention(kept, args.commits, s3=False)


if __name__ == "__main__":
    main()
