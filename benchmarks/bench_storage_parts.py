"""Parts of the one-process many-small-tensor save and load, each measured both ways in ONE run,
rounds alternating which way goes first:

- ``gcpause``: ``--tensors`` x ``--kib`` KiB saved (durably) and loaded back by our Checkpointer
  with the collector paused in the storage's own CPU work, as shipped, against the same with
  ``gc_paused`` a no-op; the process holds ``--heap`` small Python objects besides torch (a
  trainer holds hundreds of thousands: a full collection walks every one);
- ``manifest_parse``: ``json.loads`` of that step's manifest with the collector on and off;
- ``latest``: ``latest`` written as ``write_advisory`` does (no fsync) against a synced write
  (temp file, fsync, rename, fsync of the directory), in the checkpoint's own directory;
- ``crc``: 256 MiB checksummed by zlib's CRC-32, ISA-L's (a pack entry's ZIP CRC-32) and crc32c
  (every chunk's), each ``--repeats`` times in turn.

Run: ``nice -n 5 .venv/bin/python benchmarks/bench_storage_parts.py [--repeats 6]``. Prints JSON
lines: one per measurement (median, best, every round), then the ratios (the second named's time over the
first's: > 1 means the first is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

from bench_common import alternate, emit, result_line

KEEP = []  # the --heap objects: alive for the whole run, as a trainer's are


@contextlib.contextmanager
def _no_pause() -> Iterator[None]:
    yield


@contextlib.contextmanager
def _gc_pause_off() -> Iterator[None]:
    """Every storage module that pauses the collector given a no-op pause instead."""
    import resilient.storage.checkpointer as checkpointer
    import resilient.storage.commit as commit
    import resilient.storage.persist as persist

    modules = (checkpointer, commit, persist)
    real = [m.gc_paused for m in modules]
    for m in modules:
        m.gc_paused = _no_pause
    try:
        yield
    finally:
        for m, r in zip(modules, real, strict=True):
            m.gc_paused = r


def _save_load(root: str, state: dict, step: int) -> tuple[float, float]:
    import torch

    from resilient import Checkpointer

    with Checkpointer(root, keep_last=1) as ckpt:
        t0 = time.perf_counter()
        ckpt.save(step, state).wait()
        t1 = time.perf_counter()
        back = {k: torch.empty_like(v) for k, v in state.items()}
        ckpt.load(back)
        return t1 - t0, time.perf_counter() - t1


def ratio_line(name: str, ours: dict, other: dict) -> dict:
    """``other``'s time over ``ours`` (median and best): > 1 means ``ours`` is faster."""
    return {
        "bench": "ratio",
        "name": name,
        "value": round(other["seconds"] / ours["seconds"], 4),
        "best_value": round(other["best_seconds"] / ours["best_seconds"], 4),
    }


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_gcpause(args: argparse.Namespace, root: str) -> None:
    import torch

    state = {f"layers.{i}.norm": torch.randn(args.kib * 256) for i in range(args.tensors)}
    nbytes = sum(v.nbytes for v in state.values())
    times: dict[str, list[list[float]]] = {"paused": [], "not_paused": []}
    _save_load(f"{root}/warm", state, 1)
    for round_ in range(args.repeats):
        for way in alternate(round_, "paused", "not_paused"):
            with _gc_pause_off() if way == "not_paused" else contextlib.nullcontext():
                times[way].append(list(_save_load(f"{root}/{way}", state, round_ + 1)))
    lines = {}
    for way, got in times.items():
        for n, bench in enumerate(("save_small", "load_small")):
            lines[bench, way] = result_line(bench, way, nbytes, [t[n] for t in got], from_world=1, to_world=1)
            emit(lines[bench, way])
    for bench in ("save_small", "load_small"):
        emit(ratio_line(f"{bench}_paused_over_not_paused", lines[bench, "paused"], lines[bench, "not_paused"]))


def bench_manifest_parse(args: argparse.Namespace, root: str) -> None:
    import json
    import pathlib

    data = next(pathlib.Path(f"{root}/paused").glob("step-*/manifest.json")).read_bytes()
    times: dict[str, list[float]] = {"off": [], "on": []}
    was = gc.isenabled()
    try:
        for round_ in range(args.repeats):
            for way in alternate(round_, "off", "on"):
                (gc.disable if way == "off" else gc.enable)()
                times[way].append(_timed(lambda: json.loads(data)))
    finally:
        (gc.enable if was else gc.disable)()
    lines = {
        way: result_line("manifest_parse", f"collector_{way}", len(data), t, from_world=1, to_world=1)
        for way, t in times.items()
    }
    for line in lines.values():
        emit(line)
    emit(ratio_line("manifest_parse_collector_off_over_on", lines["off"], lines["on"]))


def bench_latest(args: argparse.Namespace, root: str) -> None:
    from resilient.storage.objects import open_store, write_advisory
    from resilient.storage.url import parse_url

    store = open_store(parse_url(f"{root}/latest-bench"))
    store.check_root(create=True)
    data = b'{"step": 1}'
    ways = {"advisory": lambda: write_advisory(store, "latest", data), "synced": lambda: store.write("latest", data)}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(args.repeats * 5):
        for way in alternate(round_, "advisory", "synced"):
            times[way].append(_timed(ways[way]))
    lines = {way: result_line("latest", way, len(data), t, from_world=1, to_world=1) for way, t in times.items()}
    for line in lines.values():
        emit(line)
    emit(ratio_line("latest_advisory_over_synced", lines["advisory"], lines["synced"]))


def bench_crc(args: argparse.Namespace) -> None:
    import zlib

    import crc32c
    import numpy as np
    from isal.isal_zlib import crc32 as isal_crc32

    data = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    ways = {"isal": isal_crc32, "zlib": zlib.crc32, "crc32c": crc32c.crc32c}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way, fn in ways.items():
            times[way].append(_timed(lambda fn=fn: fn(data)))
    lines = {way: result_line("crc", way, data.nbytes, t, from_world=1, to_world=1) for way, t in times.items()}
    for line in lines.values():
        emit(line)
    emit(ratio_line("crc_isal_over_zlib", lines["isal"], lines["zlib"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=16)
    parser.add_argument("--heap", type=int, default=300_000, help="small Python objects the process holds")
    parser.add_argument("--repeats", type=int, default=6, help="rounds of each case (even: each way first as often)")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    KEEP.extend({"i": i} for i in range(args.heap))
    root = tempfile.mkdtemp(prefix="bench_storage_parts-", dir=args.dir)
    try:
        bench_gcpause(args, root)
        bench_manifest_parse(args, root)
        bench_latest(args, root)
        bench_crc(args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
