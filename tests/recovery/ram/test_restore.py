"""The RAM tier's one collective restore decision (``recovery/ram/restore.py``), on real gloo ranks,
and on one process over a ``RamView`` of plain stores (no tier)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from resilient.recovery.channel import ReplicationClient
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram.pairing import Pairing
from resilient.recovery.ram.restore import choose_step, restore_from_ram
from resilient.recovery.ram.store import NodeStores, RankStore, node_store_dir
from resilient.recovery.ram.view import RamView
from resilient.recovery.timeline import Timeline
from tests.dist import run_world
from tests.recovery.ram import workers

pytestmark = pytest.mark.timeout(120)


BACKED = pytest.mark.parametrize("persistent_step", [None, 1], ids=["no_persistent_step", "persistent_step_behind_it"])
"""With a committed step behind the decision the snapshots go straight into the state (``ram.inplace``);
without one they are checked where they lie and copied after every rank agreed."""


@pytest.mark.dist
@BACKED
def test_restore_from_own_store_and_from_buddy_after_node_loss(tmp_path, caplog, persistent_step):
    store_dir = str(tmp_path / "store")
    results = run_world(workers.take_snapshots, 3, store_dir, [2, 4], timeout_s=90)
    for rank, result in enumerate(results):
        copied = [r["replication"] for r in result["stats"]]
        assert [c["outcome"] for c in copied] == ["copied", "copied"] and copied[0]["buddy"] == (rank + 1) % 3
        assert [r["step"] for r in result["stats"]] == [2, 4]
    secret = results[0]["secret"]
    assert {r["secret"] for r in results} == {secret}
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=1)
    shutil.rmtree(node_store_dir(config, os.path.join(store_dir, "run"), 0, 1))  # node 1 is replaced
    restored = run_world(workers.restore, 3, store_dir, persistent_step, timeout_s=90)
    assert [r["source"] for r in restored] == ["own", "buddy", "own"]
    assert all(r["sources"] == ["own", "buddy", "own"] for r in restored)  # every rank knows the mix
    # Rank 1 received its buddy's copy into fresh memory, or straight into its state; either way
    # checksummed as it landed, never in a pass of its own. Ranks 0 and 2 check their own snapshot
    # where it lies (one pass), or as they copy it into the state.
    assert [r["fresh_memory"] for r in restored] == [0, 1 if persistent_step is None else 0, 0]
    assert [r["crc_passes"] for r in restored] == ([1, 0, 1] if persistent_step is None else [0, 0, 0])
    for rank, r in enumerate(restored):
        assert r["step"] == 4 and r["w"] == rank * 1000 + 4 and r["b_equal"] and r["optim_step"] == 4.0
        assert r["train"] == {"step": 4, "rank": rank}
    # The job's secret is in no file the tier wrote.
    for path in Path(store_dir).rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret.encode() not in data and bytes.fromhex(secret) not in data, path


@pytest.mark.dist
@BACKED
def test_corrupt_snapshot_falls_back_to_the_buddy_copy_then_to_an_older_step(tmp_path, persistent_step):
    # In place, the corrupt step-4 bytes land in the state before their crc fails; step 2 must
    # overwrite every one of them.
    store_dir = str(tmp_path / "store")
    run_world(workers.take_snapshots, 2, store_dir, [2, 4], timeout_s=90)
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=1)
    run_dir = os.path.join(store_dir, "run")
    own0 = RankStore(os.path.join(node_store_dir(config, run_dir, 0, 0), "own", "rank0"), keep=2)
    index = own0.indexes()[4]
    own0.data(index)[index.tensors[0].offset] ^= 1  # rank 0's own step 4 is corrupt
    restored = run_world(workers.restore, 2, store_dir, persistent_step, timeout_s=90)
    assert [(r["step"], r["source"]) for r in restored] == [(4, "buddy"), (4, "own")]
    assert restored[0]["excluded"] == [{"step": 4, "source": "own", "reason": "crc32c mismatch in tensor 'model.w'"}]
    # Now rank 0's buddy copy of step 4 (kept on node 1) is corrupt too: step 4 goes for everyone.
    kept = RankStore(os.path.join(node_store_dir(config, run_dir, 0, 1), "buddy", "rank0"), keep=2)
    kept.data(kept.indexes()[4])[index.tensors[0].offset] ^= 1
    restored = run_world(workers.restore, 2, store_dir, persistent_step, timeout_s=90)
    assert [(r["step"], r["source"]) for r in restored] == [(2, "own"), (2, "own")]
    assert [r["w"] for r in restored] == [2.0, 1002.0]
    assert all(r["b_equal"] and r["optim_step"] == 2.0 for r in restored)
    assert {e["source"] for e in restored[0]["excluded"]} == {"own", "buddy"}


@pytest.mark.dist
def test_newer_persistent_step_or_other_world_size_means_no_ram_restore(tmp_path):
    store_dir = str(tmp_path / "store")
    run_world(workers.take_snapshots, 2, store_dir, [2, 4], timeout_s=90)
    newer = run_world(workers.restore, 2, store_dir, 6, timeout_s=90)
    assert [(r["step"], r["source"]) for r in newer] == [(None, None), (None, None)]
    resized = run_world(workers.restore, 1, store_dir, None, timeout_s=90)
    assert resized[0]["source"] is None
    assert any("another topology" in e["reason"] for e in resized[0]["excluded"])


@pytest.mark.dist
def test_missing_slot_file_falls_back_to_the_buddy_without_hanging(tmp_path):
    store_dir = str(tmp_path / "store")
    run_world(workers.take_snapshots, 2, store_dir, [2], timeout_s=90)
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=1)
    own = Path(node_store_dir(config, os.path.join(store_dir, "run"), 0, 1)) / "own" / "rank1"
    for slot in own.glob("slot*.bin"):
        slot.unlink()
    restored = run_world(workers.restore, 2, store_dir, None, timeout_s=90)
    assert [(r["step"], r["source"]) for r in restored] == [(2, "own"), (2, "buddy")]
    assert "FileNotFoundError" in restored[1]["excluded"][0]["reason"]


@pytest.mark.dist
def test_without_a_persistent_step_a_rank_whose_peer_fails_keeps_its_initial_state(tmp_path):
    # Rank 1 has no copy of step 2 left (its node was replaced and the copy its buddy keeps is
    # corrupt), so nothing is restored from RAM, and with no persistent step the job starts fresh:
    # rank 0, whose own snapshot was fine, must not hold step 2 while rank 1 holds the initial state.
    store_dir = str(tmp_path / "store")
    run_world(workers.take_snapshots, 2, store_dir, [2], timeout_s=90)
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=1)
    run_dir = os.path.join(store_dir, "run")
    shutil.rmtree(node_store_dir(config, run_dir, 0, 1))
    kept = RankStore(os.path.join(node_store_dir(config, run_dir, 0, 0), "buddy", "rank1"), keep=2)
    index = kept.indexes()[2]
    kept.data(index)[index.tensors[0].offset] ^= 1
    restored = run_world(workers.restore, 2, store_dir, None, timeout_s=90)
    assert [(r["step"], r["source"]) for r in restored] == [(None, None), (None, None)]
    assert [r["w"] for r in restored] == [0.0, 0.0]
    assert [r["train"] for r in restored] == [{"step": -1, "rank": -1}] * 2
    assert restored[1]["excluded"][-1]["reason"] == "crc32c mismatch in tensor 'model.w'"


def test_the_choice_is_the_newest_step_every_rank_gets_from_its_own_store_or_its_buddy():
    # rank r's copies are kept by rank r+1
    reports = [
        {"own": [2, 4, 6], "kept": {"2": [4, 6]}},
        {"own": [2], "kept": {"0": [2, 4, 6]}},  # rank 1 lost 4 and 6 ...
        {"own": [2, 4, 6], "kept": {"1": [2, 4]}},  # ... but rank 2 keeps its copy of 4
    ]
    assert choose_step(reports, set()) == 4
    assert choose_step(reports, {4}) == 2
    assert choose_step(reports, {2, 4}) is None
    # one node: no buddies, own snapshots only
    assert choose_step([{"own": [1, 3], "kept": {}}, {"own": [3], "kept": {}}], set()) == 3


def test_the_decision_needs_only_a_view_and_says_why_each_snapshot_cannot_restore(tmp_path):
    # One rank, one process (``dist.agree`` runs locally): the stores, timeline and topology come
    # from the view alone. Each snapshot that cannot restore is excluded with its one reason.
    def no_network(rank: int) -> ReplicationClient:
        raise AssertionError("nothing to fetch from another rank")

    stores = NodeStores(str(tmp_path), keep=4)
    own, current = stores.own(0), ("run", "0-aa")
    workers.write_snapshot(own, 2, 2.0, tags=current)
    workers.write_snapshot(own, 3, 3.0, tags=("run", "0-old"))  # an abandoned timeline
    workers.write_snapshot(own, 5, 5.0, tags=current)  # after the step asked for
    kept = stores.kept(0)
    workers.write_snapshot(kept, 4, 4.0, tags=current)
    stray = kept.indexes()[4]
    stray.rank = 1  # another rank's snapshot, in the copies kept for rank 0 (left by a renumbering)
    kept.publish(stray)
    view = RamView(0, Pairing(1, 1), own, stores, Timeline("run", 0, "0-aa"), topology={}, connect=no_network)
    state = {"a": torch.zeros(5, 3), "b": torch.zeros(4).bfloat16(), "v": 0.0}
    result = restore_from_ram(view, state, None, newest=4)
    assert (result.step, result.source, result.sources) == (2, "own", ["own"])
    assert state["v"] == 2.0 and torch.equal(state["a"], torch.full((5, 3), 2.0))
    reasons = {e["step"]: (e["source"], e["reason"]) for e in result.excluded}
    assert reasons == {
        3: ("own", "timeline '0-old' was abandoned: a restore not from RAM or a load_step began '0-aa'"),
        5: ("own", "newer than the step asked for (checkpoint.load_step=4)"),
        4: ("buddy", "copy kept for rank 0: taken on rank 1, not 0"),
    }
    assert sorted(own.indexes()) == [2] and kept.indexes() == {}  # the abandoned steps after 2 are hidden
