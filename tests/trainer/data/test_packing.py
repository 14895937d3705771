from __future__ import annotations

import numpy as np
import pytest

from resilient.trainer.data import PAD, DataConfig, OmniPipeline, RowKey, RowStream, batch_token_fill
from resilient.trainer.data.packing import epoch_order, first_fit


@pytest.mark.timeout(10)
def test_first_fit_places_each_item_in_the_first_row_with_room() -> None:
    # 200 fits beside the first 300, 100 beside the second; 250 fits nowhere and opens a row;
    # 700 > 512 counts as a full row (it will be truncated) and gets one of its own.
    assert first_fit([300, 300, 200, 100, 250, 700], 512) == [[0, 2], [1, 3], [4], [5]]
    assert first_fit([], 512) == []


@pytest.mark.timeout(10)
def test_epoch_order_is_a_seeded_permutation() -> None:
    first = epoch_order(seed=1, epoch=0, num_samples=1000)
    assert sorted(first.tolist()) == list(range(1000))
    np.testing.assert_array_equal(first, epoch_order(seed=1, epoch=0, num_samples=1000))
    assert not np.array_equal(first, epoch_order(seed=1, epoch=1, num_samples=1000))
    assert not np.array_equal(first, epoch_order(seed=2, epoch=0, num_samples=1000))


@pytest.mark.timeout(30)
def test_every_sample_exactly_once_per_epoch(small_config: DataConfig) -> None:
    pipe = OmniPipeline(small_config)
    seen: dict[int, list[str]] = {0: [], 1: []}
    while pipe.cursor.epoch < 2:
        batch = pipe.next_batch()
        keys = pipe.rows_for_step(pipe.cursor, 0, 1)
        for key, ids in zip(keys, batch["sample_ids"], strict=True):
            if key.epoch in seen:
                seen[key.epoch].extend(ids)
        pipe.commit_step()
    for epoch, ids in seen.items():
        assert sorted(ids) == sorted(f"{epoch}:{i}" for i in range(small_config.num_samples))
    assert seen[0] != seen[1]  # each epoch has its own order


@pytest.mark.timeout(30)
def test_default_token_fill_is_at_least_90_percent() -> None:
    stream = RowStream(DataConfig())
    fills = [stream.plan(epoch).token_fill for epoch in range(3)]
    assert min(fills) >= 0.90, fills
    batch = stream.batch(stream.rows_for_step(RowKey(0, 0), 0, 1))
    measured = batch_token_fill(batch)
    plan = stream.plan(0)
    assert measured == pytest.approx(plan.row_tokens[:8].sum() / (8 * 512))
    print(f'{{"metric": "token_fill", "epochs": {[round(f, 4) for f in fills]}, "first_batch": {measured:.4f}}}')


@pytest.mark.timeout(30)
def test_documents_in_a_row(small_config: DataConfig) -> None:
    stream = RowStream(small_config)
    batch = stream.batch([RowKey(0, r) for r in range(4)])
    for b, ids in enumerate(batch["sample_ids"]):
        doc_ids = batch["doc_ids"][b]
        used = batch["modality"][b] != PAD
        assert ((doc_ids == -1) == ~used).all()
        assert doc_ids[used].unique().tolist() == list(range(len(ids)))
        assert (doc_ids[used].diff() >= 0).all()  # documents are contiguous and in order
        starts = np.flatnonzero(np.diff(doc_ids.numpy(), prepend=-2) != 0)
        for start in starts:
            if doc_ids[start] >= 0:
                assert batch["positions"][b, start] == 0  # positions restart per document
        assert (batch["text_tokens"][b][batch["modality"][b] != 1] == 0).all()
        assert (batch["audio_frames"][b][batch["modality"][b] != 2] == 0).all()
        assert (batch["video_patches"][b][batch["modality"][b] != 3] == 0).all()


@pytest.mark.timeout(30)
def test_sample_longer_than_row_is_truncated() -> None:
    config = DataConfig(row_len=64, num_samples=8, min_clip_seconds=2.0, max_clip_seconds=3.0)
    assert config.max_sample_tokens > 64
    stream = RowStream(config)
    assert stream.rows_in_epoch(0) == 8  # one sample per row
    batch = stream.batch([RowKey(0, 0)])
    assert len(batch["sample_ids"][0]) == 1
    assert (batch["doc_ids"][0] == 0).all() and batch_token_fill(batch) == 1.0
