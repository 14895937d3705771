"""``resilient-data build`` skips a bad sample with its reason and always exits: a caption nested
too deeply, a decoder's unexpected error, a file that shrinks between probe and write, a probe
that hangs (before, each ended the whole build, or kept the finished process from exiting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from resilient.tools.media_corpus import write_corpus
from resilient.trainer.data.shards import build as build_module
from resilient.trainer.data.shards import probe_pool
from resilient.trainer.data.shards.build import BuildConfig, build

pytestmark = pytest.mark.timeout(90)
CLIPS = 4
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def corpus(tmp_path) -> str:
    folder = str(tmp_path / "corpus")
    write_corpus(folder, clips=CLIPS, seed=0)
    return folder


def _skipped(dest: str) -> dict[str, str]:
    with open(os.path.join(dest, "skipped.jsonl")) as f:
        return {os.path.basename(s["path"]): s["reason"] for s in map(json.loads, f)}


def _kept(dest: str) -> list[str]:
    with open(os.path.join(dest, "manifest.json")) as f:
        manifest = json.load(f)
    keys = []
    for shard in manifest["shards"]:
        with open(os.path.join(dest, shard["index"])) as f:
            index = json.load(f)
        with tarfile.open(os.path.join(dest, shard["tar"])) as tar:  # a whole, readable tar
            names = tar.getnames()
        for sample in index["samples"]:
            assert all(f"{sample['key']}.{ext}" in names for ext in sample["members"])
            keys.append(sample["key"])
    assert manifest["samples"] == len(keys)
    return keys


def test_a_caption_nested_too_deeply_skips_its_sample(corpus, tmp_path):
    Path(corpus, "clip01.json").write_text("[" * 200_000 + "]" * 200_000)  # before: RecursionError
    dest = str(tmp_path / "out")
    build(BuildConfig(src=corpus, dest=dest, shard_size=1 << 20, workers=2))
    assert "nested too deeply" in _skipped(dest)["clip01.json"]
    assert _kept(dest) == ["clip00", "clip02"]  # (clip03 of the corpus is damaged on purpose)


def test_a_decoders_unexpected_error_skips_its_sample(corpus, tmp_path, monkeypatch):
    real = probe_pool.probe

    def crashing(path: str):
        if path.endswith("clip00.mp4"):
            raise RuntimeError("decoder state corrupted")  # not a ProbeError: before, the build ended
        return real(path)

    monkeypatch.setattr(probe_pool, "probe", crashing)
    dest = str(tmp_path / "out")
    build(BuildConfig(src=corpus, dest=dest, shard_size=1 << 20, workers=2))
    assert "probe failed: RuntimeError: decoder state corrupted" in _skipped(dest).values()
    assert _kept(dest) == ["clip01", "clip02"]


def test_a_file_that_shrinks_between_probe_and_write_skips_its_sample(corpus, tmp_path, monkeypatch):
    real = build_module.probe_all

    def then_shrink(*args, **kwargs):
        probed = real(*args, **kwargs)
        path = os.path.join(corpus, "clip00.mp4")
        os.truncate(path, os.path.getsize(path) // 2)
        return probed

    monkeypatch.setattr(build_module, "probe_all", then_shrink)
    dest = str(tmp_path / "out")
    summary = build(BuildConfig(src=corpus, dest=dest, shard_size=1 << 20, workers=2))
    assert _skipped(dest)["clip00.mp4"].startswith("changed since it was probed")
    assert _kept(dest) == ["clip01", "clip02"] and (summary.samples, summary.skipped) == (2, 2)


HUNG = """
import sys, threading
from resilient.trainer.data.shards import probe_pool
from resilient.trainer.data.shards.build import BuildConfig, build
probe_pool.SAMPLE_TIMEOUT_S = 2.0
real = probe_pool.probe
def hung(path):
    if path.endswith("clip02.flac"):
        threading.Event().wait()  # a read on a dead mount: never returns
    return real(path)
probe_pool.probe = hung
print(build(BuildConfig(src=sys.argv[1], dest=sys.argv[2], shard_size=1 << 20, workers=2)).samples, flush=True)
"""


def test_a_hung_probe_is_skipped_and_the_build_still_exits(corpus, tmp_path):
    dest = str(tmp_path / "out")
    # Before: the summary printed, then the process never exited (the pool joined the hung thread).
    done = subprocess.run(
        [sys.executable, "-c", HUNG, corpus, dest], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2"
    assert any("did not finish within 2 s" in reason for reason in _skipped(dest).values())
