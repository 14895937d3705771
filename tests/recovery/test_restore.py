"""The one restore policy (``recovery/restore.py``): peer -> own RAM -> buddy RAM -> persistent -> fresh.

Real objects throughout: a Checkpointer on a temporary directory (or the loopback S3 endpoint), a
RamTier in one process without a process group, and two gloo ranks for the collective decisions.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.errors import StorageError
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram import node_store_dir
from resilient.recovery.restore import PeerHeal, RestoreResult, committed_steps, describe
from resilient.storage.checkpointer import Checkpointer
from tests.dist import run_world
from tests.recovery.policy import LAYOUT, events, restore_with, save, snapshot, snapshot_rank, start_run, tier

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def ckpt(tmp_path: Path):
    with Checkpointer(str(tmp_path / "ckpt")) as checkpointer:
        yield checkpointer


@pytest.fixture
def ram(tmp_path: Path):
    ram_tier = tier(tmp_path / "store")
    yield ram_tier
    ram_tier.close()


# -- one process ---------------------------------------------------------------------------------


def test_nothing_anywhere_is_a_fresh_start_with_one_event(tmp_path, ckpt):
    result, trainer, said = restore_with(tmp_path / "run", ckpt)
    timeline = result.timeline
    assert timeline is not None and timeline.incarnation == 0 and timeline.root == ckpt.url
    assert result == RestoreResult(step=0, source="fresh", seconds=result.seconds, timeline=timeline)
    assert trainer.built == 1 and trainer.applied is None
    assert said == [f"no checkpoint under {ckpt.url}: starting at step 0"]
    assert events(tmp_path / "run") == [
        {
            "event": "restore",
            "group": 0,
            "rank": 0,
            "step": 0,
            "source": "fresh",
            "bytes": 0,
            "seconds": round(result.seconds, 6),
            "storage_reads": 0,
            "excluded": [],
            "run_id": timeline.run_id,
            "timeline_incarnation": 0,
            "timeline": timeline.timeline,
        }
    ]


def test_the_newest_committed_checkpoint_when_there_is_no_ram_tier(tmp_path, ckpt):
    save(ckpt, 2, 4)
    result, trainer, said = restore_with(tmp_path / "run", ckpt)
    assert (result.source, result.step) == ("persistent", 4)
    assert result.storage_reads > 0 and result.bytes > 0 and result.excluded == []
    assert trainer.applied is not None and torch.equal(trainer.applied["model"]["w"], torch.full((8, 4), 4.0))
    assert trainer.applied["train"] == {"step": 4, "tokens_seen": 40}
    assert said[0].startswith(f"resumed from step 4 of {ckpt.url} on {LAYOUT} in ") and said[0].endswith(" s")
    (event,) = events(tmp_path / "run")
    assert (event["source"], event["step"], event["storage_reads"]) == ("persistent", 4, result.storage_reads)


def test_own_ram_wins_when_not_older_than_the_checkpoint_and_reads_no_storage(tmp_path, ckpt, ram):
    start_run(tmp_path / "run", ckpt, ram)
    save(ckpt, 4)
    snapshot(ram, 2, 4)  # step 4 is in RAM and in storage: RAM is the faster tier
    result, trainer, said = restore_with(tmp_path / "run", ckpt, ram)
    assert (result.source, result.step, result.storage_reads) == ("own", 4, 0)
    assert result.bytes > 0 and result.excluded == []
    assert trainer.applied is not None and float(trainer.applied["model"]["w"][0, 0]) == 1004.0
    assert said[0].startswith(f"resumed from step 4 of this node's RAM on {LAYOUT} in ")
    assert events(tmp_path / "run")[0]["source"] == "own"


def test_a_newer_checkpoint_beats_older_ram_snapshots(tmp_path, ckpt, ram):
    start_run(tmp_path / "run", ckpt, ram)
    snapshot(ram, 2, 4)
    save(ckpt, 6)
    result, trainer, _ = restore_with(tmp_path / "run", ckpt, ram)
    assert (result.source, result.step) == ("persistent", 6) and result.storage_reads > 0
    assert trainer.applied is not None and float(trainer.applied["model"]["w"][0, 0]) == 6.0


@pytest.mark.parametrize("damaged", [0, 1], ids=["first_tensor", "second_tensor"])
def test_a_corrupt_snapshot_without_a_buddy_is_excluded_and_storage_restores(tmp_path, ckpt, ram, damaged):
    # With committed step 2 behind the decision, step 4 is copied into the state as it is checked
    # (``ram.inplace``): its good first tensor (1004.0) and the damaged bytes land there before the
    # crc fails, and the persistent load must overwrite every one of them.
    start_run(tmp_path / "run", ckpt, ram)
    save(ckpt, 2)
    snapshot(ram, 4)
    index = ram.own.indexes()[4]
    ram.own.data(index)[index.tensors[damaged].offset] ^= 1
    result, caller, _ = restore_with(tmp_path / "run", ckpt, ram)
    assert (result.source, result.step) == ("persistent", 2)
    fqn = index.tensors[damaged].fqn
    assert result.excluded == [{"step": 4, "source": "own", "reason": f"crc32c mismatch in tensor '{fqn}'"}]
    assert events(tmp_path / "run")[0]["excluded"] == result.excluded
    assert caller.applied is not None
    assert torch.equal(caller.applied["model"]["w"], torch.full((8, 4), 2.0))
    assert torch.equal(caller.applied["model"]["z"], torch.full((4, 4), 2.5))
    assert caller.applied["train"] == {"step": 2, "tokens_seen": 20}


def test_a_listing_error_still_lets_ram_restore_and_is_raised_without_it(tmp_path, ram):
    root = tmp_path / "not-a-dir"
    root.write_text("")  # the checkpoint root is a file: listing fails
    broken = Checkpointer(str(root))
    with pytest.raises(StorageError, match="cannot list checkpoints to resume from: .* is not a directory"):
        restore_with(tmp_path / "run", broken)  # no RAM tier: raised
    with pytest.raises(StorageError, match="is not a directory"):
        restore_with(tmp_path / "run", broken, ram)  # RAM tier with nothing in it: the listing error
    start_run(tmp_path / "run", Checkpointer(str(tmp_path / "ckpt")), ram)
    snapshot(ram, 3)
    with pytest.raises(StorageError, match="is not a directory"):
        restore_with(tmp_path / "run", broken, ram)  # the record names another root: not trusted for this one
    record = tmp_path / "run" / "group0" / "timeline.json"
    record.write_text(record.read_text().replace(str(tmp_path / "ckpt"), str(root)))
    result, _, _ = restore_with(tmp_path / "run", broken, ram)
    assert (result.source, result.step, result.storage_reads) == ("own", 3, 0)
    assert [e["source"] for e in events(tmp_path / "run")] == ["own"]  # failures wrote no event


def test_a_missing_bucket_is_an_error_and_an_empty_memory_store_a_fresh_start(tmp_path, s3_endpoint):
    with pytest.raises(StorageError, match="no-such-bucket"):
        restore_with(tmp_path / "run", Checkpointer("s3://no-such-bucket/run"))
    result, _, _ = restore_with(tmp_path / "run", Checkpointer("memory://restore-policy-empty"))
    assert (result.source, result.step) == ("fresh", 0)


def test_resume_off_is_fresh_without_building_state_or_writing_an_event(tmp_path, ckpt):
    save(ckpt, 2)
    result, trainer, said = restore_with(tmp_path / "run", ckpt, resume=False)
    assert (result.source, result.step) == ("fresh", 0)
    assert trainer.built == 0 and said == [] and not (tmp_path / "run" / "events.jsonl").exists()


def test_a_peer_heal_comes_first_and_is_recorded_without_touching_storage(tmp_path, ckpt, ram):
    save(ckpt, 6)
    snapshot(ram, 8)
    result, trainer, said = restore_with(tmp_path / "run", ckpt, ram, peer=PeerHeal(step=7, bytes=1234, seconds=0.5))
    timeline = result.timeline
    assert timeline is not None and ram.timeline == timeline  # no record yet: the heal starts one
    assert result == RestoreResult(step=7, source="peer", bytes=1234, seconds=0.5, timeline=timeline)
    assert trainer.built == 0 and trainer.applied is None and said == [] and ckpt.storage_reads == 0
    assert events(tmp_path / "run") == [
        {
            "event": "restore",
            "group": 0,
            "rank": 0,
            "step": 7,
            "source": "peer",
            "bytes": 1234,
            "seconds": 0.5,
            "storage_reads": 0,
            "excluded": [],
            "run_id": timeline.run_id,
            "timeline_incarnation": 0,
            "timeline": timeline.timeline,
        }
    ]


# -- two gloo ranks ------------------------------------------------------------------------------


def _restore_rank(rank: int, world: int, store_dir: str, ckpt_url: str, run_dir: str) -> dict[str, Any]:
    ram = tier(Path(store_dir), rank=rank, world=world)
    try:
        with Checkpointer(ckpt_url) as ckpt:
            result, trainer, _ = restore_with(Path(run_dir), ckpt, ram)
            steps = committed_steps(ckpt)
    except StorageError as e:
        return {"error": str(e)}
    finally:
        ram.close()
    w = None if trainer.applied is None else float(trainer.applied["model"]["w"][0, 0])
    return {"source": result.source, "step": result.step, "reads": result.storage_reads, "w": w, "steps": steps}


@pytest.mark.dist
def test_a_lost_node_restores_from_its_buddy_and_ranks_fail_together(tmp_path):
    store, run_dir = tmp_path / "store", tmp_path / "run"
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        save(ckpt, 2)
    run_world(snapshot_rank, 2, str(store), [4], str(tmp_path / "ckpt"), str(run_dir), timeout_s=90)
    config = RamTierConfig(store_dir=str(store), ranks_per_node=1)
    shutil.rmtree(node_store_dir(config, str(store / "run"), 0, 1))  # node 1 is replaced
    restored = run_world(_restore_rank, 2, str(store), str(tmp_path / "ckpt"), str(run_dir), timeout_s=90)
    assert [(r["source"], r["step"], r["reads"]) for r in restored] == [("own", 4, 0), ("buddy", 4, 0)]
    assert [r["w"] for r in restored] == [1004.0, 1004.0] and [r["steps"] for r in restored] == [[2], [2]]
    assert sorted((e["rank"], e["source"]) for e in events(run_dir)) == [(0, "own"), (1, "buddy")]
    # Now rank 0's own snapshot is gone too (its copy went with node 1): no RAM step is common, and
    # the checkpoint root cannot be listed. Every rank raises rank 0's listing error.
    shutil.rmtree(os.path.join(node_store_dir(config, str(store / "run"), 0, 0), "own"))
    (tmp_path / "gone").write_text("")
    failed = run_world(_restore_rank, 2, str(store), str(tmp_path / "gone"), str(run_dir), timeout_s=90)
    assert failed[0] == failed[1] and failed[0]["error"].startswith("[rank 0] cannot list checkpoints to resume")


def test_the_restore_line_names_each_ranks_ram_source_when_they_differ():
    # Rank 0 prints the group's line: "this node's RAM" would be wrong for a rank that lost its node.
    mixed = RestoreResult(10, "own", seconds=0.5, group_sources=["own", "buddy", "own"])
    line = describe(mixed, "file:///ckpt", "dp_shard=3 x tp=1")
    assert line == (
        "resumed from step 10 of RAM (own snapshot on ranks [0, 2], the buddy node's copy on ranks [1]) "
        "on dp_shard=3 x tp=1 in 0.50 s"
    )
    same = RestoreResult(10, "own", seconds=0.5, group_sources=["own", "own"])
    assert describe(same, "file:///ckpt", "dp_shard=2 x tp=1").startswith("resumed from step 10 of this node's RAM")
