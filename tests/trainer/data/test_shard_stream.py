"""The row stream over a real shard build (trainer/data/shard_source.py): time alignment read back
from decoded content, the same rows from S3 as from a folder, deterministic skips on every share,
and config errors that name the key."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from resilient.errors import ConfigError
from resilient.trainer.config import load_config
from resilient.trainer.data import AUDIO, VIDEO, DataConfig, OmniSource, RowKey, RowStream
from resilient.trainer.data.shard_source import ShardSource, resolve_build
from resilient.trainer.data.vocab import SIZES

from .decode import audio_times, frame_time, patches_to_frame

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]
CLIPS, SEED = 5, 3  # clip00 mp4 H.264 + AAC, clip01 MPEG-4 video only, clip02 FLAC, clip03 WAV, clip04 corrupt


def _build(src: Path, dest: str) -> None:
    command = [sys.executable, "-m", "resilient.tools.data", "build", str(src), "--out", dest, "--shard-size", "64KiB"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[Path, Path]:
    from resilient.tools.media_corpus import write_corpus

    root = tmp_path_factory.mktemp("media")
    write_corpus(str(root / "corpus"), clips=CLIPS, seed=SEED)
    _build(root / "corpus", str(root / "shards"))
    return root / "corpus", root / "shards"


def _config(shards: str, **changes) -> DataConfig:
    base = DataConfig(source="shards", shards=shards, row_len=512, global_rows=2, num_workers=0, **changes)
    return resolve_build(base, vocab_given=False)


def test_audio_and_video_of_a_real_mp4_share_positions_by_content(build) -> None:
    # clip00 is synthetic clip 0 encoded as H.264 + AAC: its pitch (heard) and the square's x
    # (seen) both tell the time, so each token's temporal position can be checked against them.
    _, shards = build
    config = _config(str(shards), max_clip_seconds=8.0)
    source = ShardSource(config)
    item = next(i for i in range(source.num_items) if source.name(i) == "clip00")
    sample = source.sample(item)
    params = OmniSource(DataConfig(seed=SEED, min_clip_seconds=1.0, max_clip_seconds=4.0)).params(0)
    lead = int(np.flatnonzero(sample.modality != 1)[0])  # untimed caption first
    audio_pos = sample.positions[sample.modality == AUDIO] - lead
    assert audio_pos.tolist() == list(range(len(audio_pos))) and abs(len(audio_pos) - params.audio_frames) <= 1
    heard = audio_times(sample.audio_frames, params, config)
    middle = slice(2, len(heard) - 2)  # AAC's first and last frames smear
    np.testing.assert_allclose(heard[middle], (audio_pos[middle] + 0.5) * 0.04, atol=0.12)
    video_pos = sample.positions[sample.modality == VIDEO] - lead
    per = config.patches_per_frame
    frames = sample.video_patches.reshape(-1, per, config.video_dim)
    assert len(frames) == int(config.video_frames(np.asarray(len(audio_pos))))
    for j, patches in enumerate(frames):
        seen = frame_time(
            patches_to_frame(patches, config.frame_size, config.patch_size), params, SIZES[params.size], 16
        )
        position = int(video_pos[j * per])
        assert position == (25 * j) // config.video_fps
        # The frame shown at a position and the sound heard there tell the same time, within a frame.
        assert abs(seen - position * 0.04) <= 1.0 / config.video_fps / 2 + 0.04, (j, seen, position)


def test_every_share_skips_the_same_damaged_window(build, tmp_path) -> None:
    _, shards = build
    damaged = tmp_path / "shards"
    subprocess.run(["cp", "-r", str(shards), str(damaged)], check=True, timeout=30)
    shards_of = json.loads((damaged / "manifest.json").read_text())["shards"]
    index, flac = next(
        (index, s)
        for index in (json.loads((damaged / shard["index"]).read_text()) for shard in shards_of)
        for s in index["samples"]
        if s["audio"] == "flac"
    )
    offset, _ = flac["members"]["flac"]
    with open(damaged / index["tar"], "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * 64)
    config = _config(str(damaged), max_clip_seconds=1.0)
    stream = RowStream(config)
    whole = stream.batch(stream.rows_for_step(RowKey(0, 0), 0, 1))
    halves = [stream.batch(stream.rows_for_step(RowKey(0, 0), s, 2)) for s in range(2)]
    assert whole["skipped"] and whole["skipped"] == halves[0]["skipped"] + halves[1]["skipped"]
    assert {s["sample_id"].split(":")[1].split("#")[0] for s in whole["skipped"]} == {flac["key"]}
    for name in ("text_tokens", "audio_frames", "modality", "positions"):
        np.testing.assert_array_equal(whole[name].numpy(), np.concatenate([h[name].numpy() for h in halves]))


def test_a_build_on_s3_streams_the_same_rows_as_the_folder_then_from_its_cache(build, s3_bucket, tmp_path) -> None:
    import boto3

    corpus, shards = build
    url = f"s3://{s3_bucket}/media"
    _build(corpus, url)
    cache = tmp_path / "cache"
    local = RowStream(_config(str(shards), max_clip_seconds=2.0))
    remote = RowStream(_config(url, max_clip_seconds=2.0, cache_dir=str(cache)))
    assert remote.config.shards_fingerprint == local.config.shards_fingerprint
    epoch = local.rows_in_epoch(0)

    def same_rows() -> None:
        for cursor in (local.advance(RowKey(0, 0), row) for row in range(0, epoch, 2)):
            a, b = (s.batch(s.rows_for_step(cursor, 0, 1)) for s in (local, remote))
            assert a["sample_ids"] == b["sample_ids"] and not b["skipped"]
            for name in ("text_tokens", "audio_frames", "video_patches", "positions"):
                np.testing.assert_array_equal(a[name].numpy(), b[name].numpy())

    same_rows()  # the whole epoch: every member fetched once, and cached
    cached = [p for p in cache.rglob("*") if p.is_file()]
    assert cached and all(".tmp" not in p.name for p in cached)
    s3 = boto3.client("s3")
    for obj in s3.list_objects_v2(Bucket=s3_bucket, Prefix="media/")["Contents"]:
        if obj["Key"].endswith(".tar"):
            s3.delete_object(Bucket=s3_bucket, Key=obj["Key"])
    same_rows()  # the tars are gone from S3: every member comes from the node's cache


@pytest.mark.parametrize("url", ["s3:/bucket/build", "ftp://host/build"])
def test_a_malformed_shards_url_names_the_key(url: str) -> None:
    with pytest.raises(ConfigError, match=rf"^data.shards: (.*){url}"):
        load_config(None, ['data.source="shards"', f"data.shards={url}"])


def test_shard_settings_are_checked_when_the_config_loads(build, tmp_path) -> None:
    _, shards = build
    tiny = str(REPO / "configs" / "tiny.toml")
    base = ['data.source="shards"', f"run.dir={tmp_path / 'run'}", "parallel.tp=1"]
    with pytest.raises(ConfigError, match=r"data.source=\"shards\" needs data.shards"):
        load_config(tiny, base)
    with pytest.raises(ConfigError, match=str(tmp_path / "nowhere")):
        load_config(tiny, [*base, f"data.shards={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match="data.shards_fingerprint='abc' but the build"):
        load_config(tiny, [*base, f"data.shards={shards}", 'data.shards_fingerprint="abc"'])
    with pytest.raises(ConfigError, match="data.vocab_size=64 is smaller than the build's tokenizer"):
        load_config(tiny, [*base, f"data.shards={shards}", "data.vocab_size=64"])
    config = load_config(tiny, [*base, f"data.shards={shards}"])
    built = json.loads((shards / "manifest.json").read_text())
    assert config.model.vocab_size == built["tokenizer"]["vocab_size"]
    assert config.data.pipeline.shards_fingerprint == built["fingerprint"]
    # A copy of the build elsewhere is the same stream; another build is not.
    moved = dataclasses.replace(config.data.pipeline, shards="/elsewhere")
    from resilient.trainer.data.state import fingerprint

    assert fingerprint(moved) == fingerprint(config.data.pipeline)
    assert fingerprint(dataclasses.replace(moved, shards_fingerprint="x")) != fingerprint(config.data.pipeline)
