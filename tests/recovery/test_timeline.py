"""RAM snapshots restore only into the run and timeline they were taken on (issue 13, item 2).

``recovery/timeline.py`` and its use by the restore policy: a new checkpoint root is a new run,
and a restore that does not come from RAM abandons every snapshot taken before it, for good. One
process, a Checkpointer on a temporary directory, a RamTier with a configured store directory
(the node store outlives run directories, as ``/dev/shm`` does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from resilient.recovery.restore import PeerHeal
from resilient.recovery.timeline import Timeline
from resilient.storage.checkpointer import Checkpointer
from tests.recovery.policy import events, restore_with, save, snapshot, start_run, state, tier

pytestmark = pytest.mark.timeout(60)


def _reasons(excluded: list[dict]) -> dict[int, str]:
    return {e["step"]: e["reason"] for e in excluded}


def _run_id(root: Path) -> str | None:
    """The run id in ``<root>/run.json`` (None: none yet)."""
    path = root / "run.json"
    return json.loads(path.read_text())["run_id"] if path.exists() else None


def _record(run_dir: Path) -> dict | None:
    """The group's timeline record, ``<run.dir>/group0/timeline.json`` (None: none, or damaged)."""
    try:
        return json.loads((run_dir / "group0" / "timeline.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.parametrize("how", ["run dir deleted", "checkpoint.url elsewhere"])
def test_a_new_run_never_resumes_an_old_runs_snapshots_nor_loses_its_own_to_them(tmp_path, how):
    run = tmp_path / "run"
    ram = tier(tmp_path / "store")  # keep=2
    try:
        with Checkpointer(str(run / "ckpt")) as old:
            start_run(run, old, ram)
            save(old, 30)
            snapshot(ram, 38, 40)
        old_id = _run_id(run / "ckpt")
        if how == "run dir deleted":
            shutil.rmtree(run)  # checkpoints, events and timeline record with it
        new_root = run / "ckpt" if how == "run dir deleted" else tmp_path / "elsewhere"
        with Checkpointer(str(new_root)) as ckpt:
            result, caller, said = restore_with(run, ckpt, ram)
            # Before: "resumed from step 40 of this node's RAM", the old run's weights.
            assert (result.source, result.step, caller.applied) == ("fresh", 0, None)
            new_id = _run_id(new_root)
            assert new_id is not None and old_id is not None and new_id != old_id
            assert said == [f"no checkpoint under {ckpt.url}: starting at step 0"]
            why = f"taken by run {old_id!r}, not by run {new_id!r} of the checkpoint root"
            assert _reasons(result.excluded) == {38: why, 40: why}
            assert [e["excluded"] for e in events(run)][-1] == result.excluded
            # The new run's first snapshot survives retention (before: evicted at once by 38 and 40).
            snapshot(ram, 2)
            assert sorted(ram.own.indexes()) == [2]
            again, caller, _ = restore_with(run, ckpt, ram)
            assert (again.source, again.step, again.excluded) == ("own", 2, [])
            assert caller.applied is not None and float(caller.applied["model"]["w"][0, 0]) == 1002.0
            # A RAM restore branches off the timeline at the restored step.
            assert again.timeline is not None and result.timeline is not None
            assert (again.timeline.parent, again.timeline.branch_step) == (result.timeline.timeline, 2)
            assert again.timeline.ancestors == ((result.timeline.timeline, 2),)
    finally:
        ram.close()


def test_a_restore_not_from_ram_abandons_every_older_snapshot_for_good(tmp_path):
    run, ckpt = tmp_path / "run", Checkpointer(str(tmp_path / "ckpt"))
    ram = tier(tmp_path / "store")
    try:
        start_run(run, ckpt, ram)
        first = _record(run)
        save(ckpt, 2)
        snapshot(ram, 4, 6)
        # checkpoint.resume off: the run starts again at step 0; steps 4 and 6 are another history.
        start_run(run, ckpt, ram)
        second = _record(run)
        result, caller, _ = restore_with(run, ckpt, ram)
        assert (result.source, result.step) == ("persistent", 2)  # before: own RAM step 6
        assert caller.applied is not None and float(caller.applied["model"]["w"][0, 0]) == 2.0
        assert first is not None and second is not None and second["incarnation"] == first["incarnation"] + 1
        began = "a restore not from RAM or a load_step began"
        why = f"timeline {first['timeline']!r} was abandoned: {began} {second['timeline']!r}"
        assert _reasons(result.excluded) == {4: why, 6: why}
        third = result.timeline
        assert third is not None and third.incarnation == 2 and _record(run) == third.to_json()
        snapshot(ram, 3)  # the new timeline's snapshot evicts the abandoned ones, though they are newer
        assert sorted(ram.own.indexes()) == [3]
    finally:
        ram.close()
        ckpt.close()
    # A restarted worker (a new tier, same node store) finds the timeline in the run directory.
    restarted = tier(tmp_path / "store")
    try:
        with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
            again, _, _ = restore_with(run, ckpt, restarted)
        assert (again.source, again.step) == ("own", 3)
        assert again.timeline is not None and (again.timeline.parent, again.timeline.branch_step) == (third.timeline, 3)
        assert [(e["source"], e["timeline_incarnation"]) for e in events(run)] == [("persistent", 2), ("own", 3)]
    finally:
        restarted.close()


def test_a_lost_run_dir_record_is_replaced_by_the_node_stores_and_with_both_lost_nothing_is_eligible(tmp_path):
    # Kubernetes: rank 0's pod restarted and run.dir (inside the container) went with it. Before,
    # every RAM snapshot was then ineligible (a silent fall back to storage).
    run = tmp_path / "run"
    ram = tier(tmp_path / "store")
    try:
        with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
            start_run(run, ckpt, ram)
            save(ckpt, 2)
            snapshot(ram, 4)
            recorded = _record(run)
            assert recorded is not None and ram.node_record() == recorded  # kept next to the snapshots
            (run / "group0" / "timeline.json").write_text("{not json")  # lost or damaged
            result, caller, _ = restore_with(run, ckpt, ram)
            assert (result.source, result.step) == ("own", 4)
            assert caller.applied is not None and float(caller.applied["model"]["w"][0, 0]) == 1004.0
            assert result.timeline is not None and result.timeline.parent == recorded["timeline"]
            # Both gone: nothing in RAM is eligible.
            (run / "group0" / "timeline.json").unlink()
            (Path(ram.node_dir) / "timeline.json").unlink()
            lost, _, _ = restore_with(run, ckpt, ram)
        assert (lost.source, lost.step) == ("persistent", 2)
        run_id = _run_id(tmp_path / "ckpt")
        assert _reasons(lost.excluded) == {4: f"no current timeline of run {run_id!r} is recorded in the run directory"}
        record = _record(run)
        assert record is not None and record["run_id"] == run_id and record["timeline"].startswith("0-")
    finally:
        ram.close()


@pytest.mark.timeout(30)
def test_a_heal_abandons_the_groups_own_history(tmp_path):
    # The live group rewound (restored step 40 from storage) before this group healed from it at
    # step 44: this group's snapshots 48 and 50 belong to a history the job no longer has.
    run, ckpt = tmp_path / "run", Checkpointer(str(tmp_path / "ckpt"))
    ram = tier(tmp_path / "store")  # keep=2
    try:
        start_run(run, ckpt, ram)
        before = _record(run)
        save(ckpt, 40)
        snapshot(ram, 48, 50)
        healed, _, _ = restore_with(run, ckpt, ram, peer=PeerHeal(step=44, bytes=1, seconds=0.1))
        assert before is not None and healed.timeline is not None
        assert healed.timeline.timeline != before["timeline"] and healed.timeline.incarnation == 1
        assert _record(run) == healed.timeline.to_json() and ram.timeline == healed.timeline
        snapshot(ram, 46)  # the healed history's first snapshot; before: evicted by 48 and 50 (keep=2)
        assert sorted(ram.own.indexes()) == [46]
        result, caller, _ = restore_with(run, ckpt, ram)
        # Before: "own", step 50 of the abandoned history (and the quorum healed every group from it).
        assert (result.source, result.step) == ("own", 46)
        assert caller.applied is not None and float(caller.applied["model"]["w"][0, 0]) == 1046.0
    finally:
        ram.close()
        ckpt.close()


@pytest.mark.timeout(30)
def test_a_heal_needs_no_storage(tmp_path, caplog):
    # An S3 outage while a group heals from a live peer: before, every rank raised StorageError
    # (reading run.json) and the group crash-looped; a heal never needed storage.
    run, gone = tmp_path / "run", tmp_path / "gone"
    gone.write_text("")  # a file: any read under the root fails (StorageError)
    heal = PeerHeal(step=9, bytes=1, seconds=0.1)
    with Checkpointer(str(gone)) as ckpt:
        no_ram, _, _ = restore_with(run, ckpt, None, peer=heal)
        assert (no_ram.source, no_ram.step, no_ram.timeline.timeline) == ("peer", 9, "")
        ram = tier(tmp_path / "store")
        try:
            unknown, _, _ = restore_with(run, ckpt, ram, peer=heal)
            assert unknown.timeline is not None and (unknown.timeline.run_id, unknown.timeline.timeline) == ("", "")
            assert any("cannot restore until its next restore" in r.getMessage() for r in caplog.records)
            # A record of this root: its run id is trusted, a new timeline begins without storage.
            (run / "group0").mkdir(parents=True, exist_ok=True)
            (run / "group0" / "timeline.json").write_text(
                json.dumps({"run_id": "r1", "incarnation": 3, "timeline": "3-aa", "root": ckpt.url})
            )
            known, _, _ = restore_with(run, ckpt, ram, peer=heal)
            assert known.timeline is not None and (known.timeline.run_id, known.timeline.incarnation) == ("r1", 4)
            assert known.timeline.timeline.startswith("4-") and _record(run) == known.timeline.to_json()
        finally:
            ram.close()
    assert [(e["source"], e["timeline"]) for e in events(run)][:2] == [("peer", ""), ("peer", "")]


@pytest.mark.timeout(30)
def test_a_ram_restore_to_a_step_drops_the_newer_steps_it_ruled_out(tmp_path):
    # The RAM restore goes on in its timeline: step 50, ruled out (damaged), must not stay in it
    # for a later restart to pick (held by the decision's apply: every rank drops its snapshots,
    # own and kept for buddies, after the restored step).
    run, ckpt = tmp_path / "run", Checkpointer(str(tmp_path / "ckpt"))
    ram = tier(tmp_path / "store")
    try:
        start_run(run, ckpt, ram)
        save(ckpt, 40)
        snapshot(ram, 48, 50)
        index = ram.own.indexes()[50]
        ram.own.data(index)[index.tensors[0].offset] ^= 0x40
        result, _, _ = restore_with(run, ckpt, ram)
        assert (result.source, result.step) == ("own", 48)
        assert _reasons(result.excluded) == {50: "crc32c mismatch in tensor 'model.w'"}
        assert sorted(ram.own.indexes()) == [48]
        again, _, _ = restore_with(run, ckpt, ram)
        assert (again.source, again.step) == ("own", 48)
        assert again.timeline is not None and result.timeline is not None
        assert again.timeline.ancestors[:2] == ((result.timeline.timeline, 48), *result.timeline.ancestors)
    finally:
        ram.close()
        ckpt.close()


@pytest.mark.timeout(30)
def test_a_ram_restore_branches_so_a_returning_nodes_later_steps_never_restore(tmp_path):
    # Node H holds this rank's snapshots 80 and 90, then is absent while the group restores step
    # 80 (from the ranks still there) and retrains 81-90. H comes back with its old step 90: before,
    # it was of the current timeline and restored beside the other ranks' new step 90.
    run, ckpt = tmp_path / "run", Checkpointer(str(tmp_path / "ckpt"))
    ram = tier(tmp_path / "store")  # keep=2
    node_h = tmp_path / "node-h"
    try:
        start_run(run, ckpt, ram)
        snapshot(ram, 80, 90)
        own = ram.own.directory
        shutil.copytree(own, node_h)  # what H keeps while it is away
        ram.own.remove(90)  # the ranks present have no step 90
        restored, _, _ = restore_with(run, ckpt, ram)
        assert (restored.source, restored.step) == ("own", 80)
        branch = restored.timeline
        assert branch is not None and (branch.branch_step, branch.incarnation) == (80, 1)
        assert _record(run) == branch.to_json()
        for step in (85, 90):  # retrained on the branch: other values than the first history's
            assert ram.snapshot(step, state(step, value=2000.0 + step))
            ram.wait(30)
        assert {s: i.timeline for s, i in ram.own.indexes().items()} == {85: branch.timeline, 90: branch.timeline}
    finally:
        ram.close()
    shutil.rmtree(own)
    shutil.copytree(node_h, own)  # H is back
    back = tier(tmp_path / "store")
    try:
        result, caller, _ = restore_with(run, ckpt, back)
        # Step 80 of the parent is where the branch began: still eligible; its step 90 is not.
        assert (result.source, result.step) == ("own", 80)
        assert caller.applied is not None and float(caller.applied["model"]["w"][0, 0]) == 1080.0
        assert _reasons(result.excluded) == {
            90: f"step 90 of timeline {branch.parent!r} comes after step 80, where the current timeline "
            f"{branch.timeline!r} branched off it"
        }
    finally:
        back.close()
        ckpt.close()


def test_a_branch_keeps_only_its_ancestors_steps_up_to_each_branch_step():
    root = Timeline(run_id="r", incarnation=0, timeline="0-a")
    child = Timeline(run_id="r", incarnation=1, timeline="1-b", parent="0-a", branch_step=50, ancestors=(("0-a", 50),))
    grandchild = Timeline.from_json(
        {**child.to_json(), "incarnation": 2, "timeline": "2-c", "ancestors": [["1-b", 40], ["0-a", 40]]}
    )
    assert grandchild is not None
    assert [grandchild.eligible("r", t, s) for t, s in [("2-c", 99), ("1-b", 40), ("1-b", 41), ("0-a", 40)]] == [
        True,
        True,
        False,
        True,
    ]
    assert not grandchild.eligible("r", "0-a", 45) and not grandchild.eligible("other", "2-c", 1)
    began = "a restore not from RAM or a load_step began '0-a'"
    assert root.why_not("r", "1-b", 1) == f"timeline '1-b' was abandoned: {began}"
    assert Timeline.from_json({**child.to_json(), "ancestors": [["0-a", "50"]]}) is None  # damaged: no record
