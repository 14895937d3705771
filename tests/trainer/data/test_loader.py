from __future__ import annotations

import dataclasses
import json

import psutil
import pytest
import torch

from resilient.trainer.data import DataConfig, OmniPipeline
from resilient.trainer.data.throughput import measure_throughput

TENSORS = ("text_tokens", "audio_frames", "video_patches", "modality", "positions", "doc_ids")


def _steps(pipe: OmniPipeline, steps: int) -> list[dict]:
    batches = []
    for _ in range(steps):
        batches.append(pipe.next_batch())
        pipe.commit_step()
    return batches


@pytest.mark.timeout(60)
def test_workers_do_not_change_the_stream(small_config: DataConfig) -> None:
    # Share 1 of 2 over an epoch end, and a restore while workers are prefetching.
    with OmniPipeline(small_config, share=1, num_shares=2) as inline:
        expected = _steps(inline, 7)
        state = inline.state_dict()
        expected += _steps(inline, 2)
    with OmniPipeline(dataclasses.replace(small_config, num_workers=2), share=1, num_shares=2) as pooled:
        got = _steps(pooled, 5)
        pooled.load_state_dict(state)  # jumps ahead: the prefetched batches are dropped
        got += _steps(pooled, 2)
        pooled.load_state_dict(state)  # and back: the same two steps again
        assert pooled.next_batch()["sample_ids"] == expected[7]["sample_ids"]
    assert len(got) == len(expected) - 2
    for ours, theirs in zip(got, expected[:5] + expected[7:], strict=True):
        assert ours["sample_ids"] == theirs["sample_ids"]
        for name in TENSORS:
            assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.timeout(60)
def test_close_stops_the_workers(small_config: DataConfig) -> None:
    me = psutil.Process()
    before = {child.pid for child in me.children()}
    pipe = OmniPipeline(dataclasses.replace(small_config, num_workers=2))
    pipe.next_batch()
    workers = [child for child in me.children() if child.pid not in before]
    assert len(workers) == 2
    pipe.close()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == [] and len(gone) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_throughput_report(workers: int) -> None:
    """Prints rows/s for the lead's report; asserts only what does not depend on the clock."""
    report = measure_throughput(DataConfig(num_workers=workers), steps=6)
    print(json.dumps(report))
    assert report["rows"] == 48 and report["num_workers"] == workers
    assert report["rows_per_s"] > 0 and report["token_fill"] >= 0.9
