from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from resilient.errors import ConfigError, RestoreError
from resilient.trainer.data import Batch, DataConfig, OmniPipeline, RowKey

TENSORS = ("text_tokens", "audio_frames", "video_patches", "modality", "positions", "doc_ids")


def _global_batch(shares: list[Batch]) -> Batch:
    """Concatenate the shares of one step in share order: the global batch."""
    joined: Batch = {name: torch.cat([s[name] for s in shares]) for name in TENSORS}
    joined["sample_ids"] = [ids for s in shares for ids in s["sample_ids"]]
    return joined


def _assert_same(a: Batch, b: Batch) -> None:
    assert a["sample_ids"] == b["sample_ids"]
    for name in TENSORS:
        assert torch.equal(a[name], b[name]), name


def _run(pipes: list[OmniPipeline], steps: int) -> list[Batch]:
    """Steps of a data-parallel group: every share fetches, then every share commits."""
    batches = []
    for _ in range(steps):
        batches.append(_global_batch([p.next_batch() for p in pipes]))
        for p in pipes:
            p.commit_step()
    return batches


def _group(config: DataConfig, world: int, state: dict | None = None) -> list[OmniPipeline]:
    pipes = [OmniPipeline(config, share=r, num_shares=world) for r in range(world)]
    if state is not None:
        for p in pipes:
            p.load_state_dict(json.loads(json.dumps(state)))  # what a checkpoint stores
    return pipes


@pytest.mark.timeout(60)
def test_same_global_batches_for_any_world_size(small_config: DataConfig) -> None:
    reference = _run(_group(small_config, 1), 6)  # 24 rows: crosses into epoch 1
    assert reference[-1]["sample_ids"][-1][0].startswith("1:")
    for world in (2, 4):
        batches = _run(_group(small_config, world), 6)
        for ours, theirs in zip(batches, reference, strict=True):
            _assert_same(ours, theirs)


@pytest.mark.timeout(60)
def test_resume_mid_epoch_on_4_then_2_then_1(small_config: DataConfig) -> None:
    reference = _run(_group(small_config, 1), 9)
    four = _group(small_config, 4)
    got = _run(four, 2)
    state = four[0].state_dict()
    assert state == {"version": 1, "fingerprint": four[0].fingerprint, "seed": 7, "epoch": 0, "rows_consumed": 8}
    assert all(p.state_dict() == state for p in four)
    two = _group(small_config, 2, state)
    got += _run(two, 3)
    one = _group(small_config, 1, two[1].state_dict())
    got += _run(one, 4)
    assert one[0].cursor.epoch == 1  # the resumed run crossed the epoch end too
    for ours, theirs in zip(got, reference, strict=True):
        _assert_same(ours, theirs)


@pytest.mark.timeout(30)
def test_cursor_moves_only_on_commit(small_config: DataConfig) -> None:
    pipe = OmniPipeline(small_config)
    first = pipe.next_batch()
    retried = pipe.next_batch()  # step not committed (e.g. a failed quorum): same rows again
    _assert_same(first, retried)
    assert pipe.cursor == RowKey(0, 0) and pipe.state_dict()["rows_consumed"] == 0
    pipe.commit_step()
    assert pipe.cursor == RowKey(0, 4)
    assert pipe.next_batch()["sample_ids"] != first["sample_ids"]


@pytest.mark.timeout(30)
def test_epoch_rollover(small_config: DataConfig) -> None:
    pipe = OmniPipeline(small_config)
    rows = pipe.rows_in_epoch(0)
    assert rows % 4 != 0  # so one global batch straddles the epoch end
    steps = rows // 4 + 1
    for _ in range(steps):
        pipe.commit_step()
    assert pipe.cursor == RowKey(1, steps * 4 - rows)
    straddling = pipe.rows_for_step(RowKey(0, (steps - 1) * 4), 0, 1)
    assert [key.epoch for key in straddling] == [0] * (rows % 4) + [1] * (4 - rows % 4)
    restored = OmniPipeline(small_config)
    restored.load_state_dict(pipe.state_dict())
    assert restored.cursor == pipe.cursor


@pytest.mark.timeout(30)
def test_fingerprint_mismatch_raises(small_config: DataConfig) -> None:
    state = OmniPipeline(small_config).state_dict()
    other_seed = OmniPipeline(dataclasses.replace(small_config, seed=8))
    with pytest.raises(RestoreError) as caught:
        other_seed.load_state_dict(state)
    message = str(caught.value)
    assert state["fingerprint"] in message and other_seed.fingerprint in message
    assert "seed: checkpoint 7, pipeline 8" in message
    longer_rows = OmniPipeline(dataclasses.replace(small_config, row_len=1024))
    with pytest.raises(RestoreError, match="row_len"):
        longer_rows.load_state_dict(state)
    with pytest.raises(RestoreError, match="lacks"):
        longer_rows.load_state_dict({"epoch": 0})


@pytest.mark.timeout(30)
def test_batching_settings_do_not_change_the_fingerprint(small_config: DataConfig) -> None:
    state = OmniPipeline(small_config).state_dict()
    other = dataclasses.replace(small_config, global_rows=8, num_workers=3, prefetch_factor=4)
    resumed = OmniPipeline(other)
    resumed.load_state_dict(state)  # global_rows and workers may change on resume
    assert resumed.state_dict() == state


@pytest.mark.timeout(30)
def test_shares_must_divide_the_global_batch(small_config: DataConfig) -> None:
    pipe = OmniPipeline(small_config)
    with pytest.raises(ConfigError, match="num_shares=3 does not divide DataConfig.global_rows=4"):
        pipe.rows_for_step(RowKey(0, 0), 0, 3)
    with pytest.raises(ConfigError, match="share=2"):
        pipe.rows_for_step(RowKey(0, 0), 2, 2)
    with pytest.raises(ConfigError, match="num_shares"):
        OmniPipeline(small_config, share=0, num_shares=3)


@pytest.mark.timeout(30)
def test_batches_meet_the_model_contract() -> None:
    """The model's own check of the batch contract accepts what the pipeline delivers."""
    model_batch = pytest.importorskip("resilient.trainer.model.batch")
    model_config = pytest.importorskip("resilient.trainer.model.config")
    with OmniPipeline(DataConfig(num_workers=0), share=1, num_shares=2) as pipe:
        batch = pipe.next_batch()
        config = model_config.ModelConfig(
            audio_dim=pipe.audio_dim,
            video_dim=pipe.video_dim,
            vocab_size=pipe.vocab_size,
            max_positions=pipe.max_positions,
        )
        model_batch.validate_batch(batch, config)
    assert batch["modality"].shape == (4, 512) and len(batch["sample_ids"]) == 4
    assert int(batch["positions"].max()) < pipe.max_positions == 219
