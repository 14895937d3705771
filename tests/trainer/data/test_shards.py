"""The media shard build and reader (docs/shards.md) on a real encoded corpus: what the build
writes, that tarfile / WebDataset / the index offsets all read the same bytes, determinism, a
JSON-lines SRC, ShardSet on a folder and on a real S3 endpoint, and the probe's verdicts."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile

import pytest

from resilient.errors import ConfigError, IntegrityError, StorageError
from resilient.tools.media_corpus import write_corpus
from resilient.trainer.data.shards.build import BuildConfig, build
from resilient.trainer.data.shards.format import ShardSet, fingerprint_of
from resilient.trainer.data.shards.probe import ProbeError, probe

CLIPS = 12
SHARD_SIZE = 64 << 10  # several shards from a ~300 KiB corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("corpus"))
    write_corpus(folder, clips=CLIPS, seed=0)
    return folder


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory) -> str:
    dest = str(tmp_path_factory.mktemp("built") / "shards")
    build(BuildConfig(src=corpus, dest=dest, shard_size=SHARD_SIZE, workers=4))
    return dest


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _indexes(dest: str) -> list[dict]:
    return [_json(os.path.join(dest, s["index"])) for s in _json(os.path.join(dest, "manifest.json"))["shards"]]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.timeout(60)
def test_manifest_counts_samples_skips_shards_and_fingerprint(built) -> None:
    manifest = _json(os.path.join(built, "manifest.json"))
    assert manifest["format"] == "resilient-media-shards" and manifest["version"] == 1
    assert manifest["samples"] == CLIPS - 1 and manifest["skipped"] == 1
    assert len(manifest["shards"]) > 1 and sum(s["samples"] for s in manifest["shards"]) == CLIPS - 1
    for number, shard in enumerate(manifest["shards"]):
        assert shard["tar"] == f"shard-{number:06d}.tar" and shard["index"] == f"shard-{number:06d}.json"
        assert shard["bytes"] == os.path.getsize(os.path.join(built, shard["tar"]))
    tokenizer = manifest["tokenizer"]
    assert tokenizer["file"] == "tokenizer.json" and tokenizer["kind"] == "bpe" and tokenizer["pad_id"] == 0
    assert 257 <= tokenizer["vocab_size"] <= 512
    indexes = [_read(os.path.join(built, s["index"])) for s in manifest["shards"]]
    assert manifest["fingerprint"] == fingerprint_of(indexes, _read(os.path.join(built, "tokenizer.json")))
    # clips 0..10: kinds by i % 4 = h264+aac, mpeg4 silent, flac, wav -> audio in 0,2,3; video in 0,1
    assert manifest["audio_s"] > manifest["video_s"] > 0


@pytest.mark.timeout(60)
def test_the_corrupt_file_is_skipped_with_a_reason(built, corpus) -> None:
    lines = _read(os.path.join(built, "skipped.jsonl")).decode().splitlines()
    assert [json.loads(line)["path"] for line in lines] == [os.path.join(corpus, f"clip{CLIPS - 1:02d}.mp4")]
    assert json.loads(lines[0])["reason"].startswith("FFmpeg: ")
    keys = [s["key"] for index in _indexes(built) for s in index["samples"]]
    assert keys == sorted(keys) and len(keys) == CLIPS - 1
    assert "clip03_take1" in keys and f"clip{CLIPS - 1:02d}" not in keys  # dots in a stem become "_"


@pytest.mark.timeout(60)
def test_index_describes_streams_and_every_offset_reads_the_member(built, corpus) -> None:
    entries = {s["key"]: s for index in _indexes(built) for s in index["samples"]}
    assert (entries["clip00"]["video"], entries["clip00"]["audio"]) == ("mp4", "mp4")
    assert (entries["clip01"]["video"], entries["clip01"]["audio"]) == ("mp4", None)
    assert (entries["clip02"]["video"], entries["clip02"]["audio"]) == (None, "flac")
    assert (entries["clip03_take1"]["video"], entries["clip03_take1"]["audio"]) == (None, "wav")
    assert entries["clip01"]["text"]["lead_tokens"] == 0 and len(entries["clip01"]["text"]["segments"]) >= 1
    assert entries["clip00"]["text"]["lead_tokens"] > 0 and entries["clip00"]["text"]["segments"] == []
    for index in _indexes(built):
        tar_path = os.path.join(built, index["tar"])
        data = _read(tar_path)
        with tarfile.open(tar_path) as tar:
            names = tar.getnames()
            assert names == [f"{s['key']}.{ext}" for s in index["samples"] for ext in s["members"]]
            for sample in index["samples"]:
                for ext, (offset, size) in sample["members"].items():
                    member = tar.extractfile(f"{sample['key']}.{ext}").read()
                    assert data[offset : offset + size] == member and len(member) == size
    clip02 = entries["clip02"]["members"]["flac"]
    shard = next(i for i in _indexes(built) if any(s["key"] == "clip02" for s in i["samples"]))
    stored = _read(os.path.join(built, shard["tar"]))[clip02[0] : clip02[0] + clip02[1]]
    assert stored == _read(os.path.join(corpus, "clip02.flac"))  # the original encoded file, untouched


@pytest.mark.timeout(60)
def test_webdataset_reads_the_shards_as_they_are(built) -> None:
    import webdataset

    for index in _indexes(built):
        dataset = webdataset.WebDataset(os.path.join(built, index["tar"]), shardshuffle=False)
        got = [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in dataset]
        assert got == [(s["key"], sorted(s["members"])) for s in index["samples"]]


@pytest.mark.timeout(60)
def test_two_builds_are_byte_identical(built, corpus, tmp_path) -> None:
    """The second build in another process (Rust's hash seeds differ) with one probing thread."""
    again = str(tmp_path / "again")
    command = ["build", corpus, "--out", again, "--shard-size", str(SHARD_SIZE), "--workers", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "resilient.tools.data", *command], capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(again)) == sorted(os.listdir(built))
    for name in os.listdir(built):
        assert _read(os.path.join(again, name)) == _read(os.path.join(built, name)), name
    shards = len(_indexes(built))
    assert result.stdout.startswith(f"resilient-data: {CLIPS - 1} samples, ") and f" {shards} shards, " in result.stdout


@pytest.mark.timeout(60)
def test_shardset_reads_members_text_and_token_counts(built, corpus) -> None:
    shards = ShardSet.open(built)
    tokenizer = shards.tokenizer()
    assert shards.vocab_size == tokenizer.get_vocab_size() and tokenizer.id_to_token(0) == "<pad>"
    assert shards.fingerprint == shards.manifest["fingerprint"] and len(shards.samples) == CLIPS - 1
    assert [s.key for s in shards.samples] == sorted(s.key for s in shards.samples)
    for sample in shards.samples:
        text = shards.text(sample)
        assert set(text) == {"text", "segments"}
        assert sample.lead_tokens == len(tokenizer.encode(text["text"], add_special_tokens=False).ids)
        expected = [
            (seg["start"], seg["end"], len(tokenizer.encode(seg["text"], add_special_tokens=False).ids))
            for seg in text["segments"]
        ]
        assert list(sample.segments) == expected
        assert tokenizer.decode(tokenizer.encode(text["text"]).ids) == text["text"]  # byte-level round trip
    clip00 = next(s for s in shards.samples if s.key == "clip00")
    assert shards.read_member(clip00, "mp4") == _read(os.path.join(corpus, "clip00.mp4"))
    assert shards.text(clip00)["text"] == _read(os.path.join(corpus, "clip00.txt")).decode().strip()
    copy = pickle.loads(pickle.dumps(shards))  # what a DataLoader worker gets: no fd, no client
    assert copy._store._fds == {} and copy.read_member(clip00, "mp4") == shards.read_member(clip00, "mp4")
    shards.close()


def _read_in_child(shards: ShardSet, results) -> None:
    sample = shards.samples[0]
    results.put((shards.read_member(sample, "json"), dict(shards._store._fds), os.getpid()))


@pytest.mark.timeout(60)
def test_a_forked_worker_opens_its_own_file_handles(built) -> None:
    """As a DataLoader worker under fork: the parent's open fds are inherited, not used."""
    import multiprocessing

    shards = ShardSet.open(built)
    expected = shards.read_member(shards.samples[0], "json")
    parent_fds = dict(shards._store._fds)
    assert len(parent_fds) == 1
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_read_in_child, args=(shards, results))
    child.start()
    data, child_fds, pid = results.get(timeout=30)
    child.join(timeout=30)
    assert data == expected and pid != os.getpid() and child.exitcode == 0
    assert child_fds.keys() == parent_fds.keys() and child_fds != parent_fds  # opened afresh in the child
    assert shards._store._fds == parent_fds  # the parent's own stay open and usable
    assert shards.read_member(shards.samples[0], "json") == expected
    shards.close()


@pytest.mark.timeout(60)
def test_shardset_open_refuses_what_is_not_a_finished_build(built, tmp_path) -> None:
    with pytest.raises(ConfigError, match="no readable manifest.json"):
        ShardSet.open(str(tmp_path / "nowhere"))
    unfinished = str(tmp_path / "unfinished")
    shutil.copytree(built, unfinished)
    os.remove(os.path.join(unfinished, "manifest.json"))
    with pytest.raises(ConfigError, match="a build writes its manifest last"):
        ShardSet.open(unfinished)
    newer = str(tmp_path / "newer")
    shutil.copytree(built, newer)
    manifest = _json(os.path.join(newer, "manifest.json"))
    with open(os.path.join(newer, "manifest.json"), "w") as f:
        json.dump({**manifest, "version": 2}, f)
    with pytest.raises(ConfigError, match="format version 2, this reader knows 1") as e:
        ShardSet.open(newer)
    assert "\n" not in str(e.value)
    edited = str(tmp_path / "edited")
    shutil.copytree(built, edited)
    index = os.path.join(edited, "shard-000000.json")
    emptied = {**_json(index), "samples": []}
    with open(index, "w") as f:
        json.dump(emptied, f)
    with pytest.raises(IntegrityError, match="do not match the manifest's fingerprint"):
        ShardSet.open(edited)


@pytest.mark.timeout(60)
def test_a_jsonl_manifest_src(corpus, tmp_path) -> None:
    listing = tmp_path / "list.jsonl"
    rel = os.path.relpath(corpus, tmp_path)
    rows = [
        {"id": "b.talk", "audio": f"{rel}/clip02.flac", "text": "hello there"},
        {"id": "a", "video": f"{rel}/clip01.mp4", "audio": f"{rel}/clip03.take1.wav", "text": f"{rel}/clip01.json"},
        {
            "id": "c",
            "audio": f"{rel}/clip06.flac",
            "segments": [{"start": 1, "end": 2, "text": "b"}, {"start": 0, "end": 1, "text": "a"}],
        },
        {"id": "gone", "audio": f"{rel}/missing.flac"},
    ]
    listing.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    dest = str(tmp_path / "out")
    summary = build(BuildConfig(src=str(listing), dest=dest, shard_size=1 << 20, workers=2))
    assert (summary.samples, summary.skipped, summary.shards) == (3, 2, 1)
    shards = ShardSet.open(dest)
    by_key = {s.key: s for s in shards.samples}
    assert sorted(by_key) == ["a", "b_talk", "c"]
    assert (by_key["a"].video, by_key["a"].audio) == ("mp4", "wav") and set(by_key["a"].members) == {
        "mp4",
        "wav",
        "json",
    }
    assert shards.text(by_key["a"]) == _json(os.path.join(corpus, "clip01.json"))
    assert shards.text(by_key["b_talk"]) == {"text": "hello there", "segments": []}
    assert [seg["text"] for seg in shards.text(by_key["c"])["segments"]] == ["a", "b"]  # sorted by start
    skipped = [json.loads(line) for line in _read(os.path.join(dest, "skipped.jsonl")).decode().splitlines()]
    assert {s["path"] for s in skipped} == {os.path.join(corpus, "missing.flac"), f"{listing}:5"}


@pytest.mark.timeout(60)
def test_build_and_read_on_s3(built, corpus, s3_bucket) -> None:
    dest = f"s3://{s3_bucket}/media/v1"
    summary = build(BuildConfig(src=corpus, dest=dest, shard_size=SHARD_SIZE, workers=2))
    shards = ShardSet.open(dest)
    local = ShardSet.open(built)
    assert summary.fingerprint == local.fingerprint == shards.fingerprint  # same bytes as the local build
    for remote, here in zip(shards.samples, local.samples, strict=True):
        for ext in remote.members:
            assert shards.read_member(remote, ext) == local.read_member(here, ext)
    assert pickle.loads(pickle.dumps(shards)).text(shards.samples[0]) == local.text(local.samples[0])
    with pytest.raises(ConfigError, match="already holds objects"):
        build(BuildConfig(src=corpus, dest=dest, shard_size=SHARD_SIZE, workers=2))
    import boto3

    boto3.client("s3").delete_object(Bucket=s3_bucket, Key="media/v1/shard-000000.tar")
    first = shards.samples[0]
    with pytest.raises(StorageError, match=f"reading sample '{first.key}' from shard-000000.tar at s3://"):
        shards.read_member(first, "json")


class _Flaky:
    """A boto3 client whose first ``failures`` GetObjects break off like a dropped connection."""

    def __init__(self, client, failures: int) -> None:
        self.client, self.failures, self.calls = client, failures, 0

    def get_object(self, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionResetError("connection reset by peer")
        return self.client.get_object(**kwargs)


@pytest.mark.timeout(60)
def test_s3_range_reads_are_retried_then_fail_naming_shard_and_key(corpus, s3_bucket, monkeypatch) -> None:
    from resilient.trainer.data.shards import format as fmt

    monkeypatch.setattr(fmt, "S3_BACKOFF_S", 0.01)
    dest = f"s3://{s3_bucket}/retry"
    build(BuildConfig(src=corpus, dest=dest, shard_size=SHARD_SIZE, workers=2))
    shards = ShardSet.open(dest)
    sample = shards.samples[-1]
    expected = shards.read_member(sample, "json")
    flaky = _Flaky(shards._store._client, failures=fmt.S3_READ_RETRIES)
    shards._store._client = flaky
    assert shards.read_member(sample, "json") == expected and flaky.calls == 1 + fmt.S3_READ_RETRIES
    shards._store._client = _Flaky(flaky.client, failures=99)
    tar = shards.manifest["shards"][sample.shard]["tar"]
    with pytest.raises(StorageError, match=f"sample '{sample.key}' from {tar} .* after 4 tries: connection reset"):
        shards.read_member(sample, "json")


@pytest.mark.timeout(60)
def test_probe_detects_garbage_and_truncation(corpus, tmp_path) -> None:
    info = probe(os.path.join(corpus, "clip00.mp4"))
    assert info.has_audio and info.has_video and 1.0 <= info.duration_s <= 4.1
    garbage = tmp_path / "noise.mp4"
    garbage.write_bytes(hashlib.sha256(b"x").digest() * 64)
    with pytest.raises(ProbeError, match="FFmpeg"):
        probe(str(garbage))
    flac = _read(os.path.join(corpus, "clip06.flac"))
    cut = tmp_path / "cut.flac"
    cut.write_bytes(flac[: len(flac) // 2])
    with pytest.raises(ProbeError, match="truncated"):
        probe(str(cut))
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(ProbeError, match="empty file"):
        probe(str(empty))


def _remux_faststart(src: str, dst: str) -> None:
    """The same packets with the mp4 index (moov) in front, as streaming-friendly files have it."""
    import av

    with av.open(src) as given, av.open(dst, "w", format="mp4", options={"movflags": "faststart"}) as out:
        streams = {s.index: out.add_stream_from_template(s) for s in given.streams}
        for packet in given.demux():
            if packet.dts is not None:
                packet.stream = streams[packet.stream.index]
                out.mux(packet)


@pytest.mark.timeout(60)
def test_probe_detects_a_cut_file_whose_index_survived(corpus, tmp_path) -> None:
    whole, cut = str(tmp_path / "fast.mp4"), tmp_path / "cut.mp4"
    _remux_faststart(os.path.join(corpus, "clip04.mp4"), whole)
    assert probe(whole).duration_s == pytest.approx(3.0, abs=0.1)
    data = _read(whole)
    cut.write_bytes(data[: int(len(data) * 0.7)])  # the head still decodes; the last second is gone
    with pytest.raises(ProbeError, match=r"truncated: .* of its 3\.00 s"):
        probe(str(cut))


@pytest.mark.timeout(60)
def test_samples_longer_than_the_limit_are_skipped_with_the_advice(corpus, tmp_path) -> None:
    dest = str(tmp_path / "short")
    summary = build(BuildConfig(src=corpus, dest=dest, shard_size=SHARD_SIZE, workers=2, max_duration_s=2.0))
    skipped = [json.loads(line) for line in open(os.path.join(dest, "skipped.jsonl"))]  # noqa: SIM115
    too_long = [s for s in skipped if "longer than --max-duration 2 s" in s["reason"]]
    kept = [s for index in _indexes(dest) for s in index["samples"]]
    assert too_long and all(s["duration_s"] <= 2.0 for s in kept)
    assert len(kept) + len(too_long) == CLIPS - 1 and summary.line()
