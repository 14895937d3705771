"""A RAM restore needs neither the run directory nor storage (README, "RAM tier"): Kubernetes
restarts rank 0's pod, so its run.dir (inside the container: timeline record, events, job record)
is gone, while the checkpoint store is unreachable. The node's RAM store keeps the timeline record
next to the snapshots, and the job secret comes from ``$RESILIENT_JOB_SECRET`` (the emitted
JobSet's Secret), so the snapshot stays eligible and restores with no storage read."""

from __future__ import annotations

import shutil

import pytest

from resilient.storage.checkpointer import Checkpointer
from tests.recovery.policy import events, restore_with, save, snapshot, start_run, tier

pytestmark = pytest.mark.timeout(60)


def test_a_restarted_rank0_pod_restores_from_ram_without_run_dir_or_storage(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_JOB_SECRET", "ab" * 32)  # every pod's, from the job's Secret
    run, root, store = tmp_path / "run", tmp_path / "ckpt", tmp_path / "store"
    ram = tier(store)
    try:
        with Checkpointer(str(root)) as ckpt:
            start_run(run, ckpt, ram)
            save(ckpt, 2)
            snapshot(ram, 4)
            first = ram.timeline
    finally:
        ram.close()
    # The pod restarts: a new container, its run dirs empty; the node's /dev/shm survives.
    shutil.rmtree(run)
    shutil.rmtree(store / "run", ignore_errors=True)  # the tier's own run.dir, if anything is in it
    shutil.rmtree(root)
    root.write_text("")  # storage unreachable: every read under the root fails
    restarted = tier(store)
    try:
        with Checkpointer(str(root)) as ckpt:
            result, caller, said = restore_with(run, ckpt, restarted)
        assert (result.source, result.step, result.storage_reads) == ("own", 4, 0)
        assert result.excluded == []
        assert caller.applied is not None and float(caller.applied["model"]["w"][0, 0]) == 1004.0
        assert first is not None and result.timeline is not None
        assert (result.timeline.run_id, result.timeline.parent) == (first.run_id, first.timeline)
        assert result.timeline.branch_step == 4
        assert len(said) == 1 and "step 4" in said[0]
        # The new run dir has the restore's event and the branch record again.
        assert [(e["source"], e["step"]) for e in events(run)] == [("own", 4)]
        # It names the snapshot's timeline and what the branch keeps eligible (chaos: ram_restores_on_branch).
        (event,) = events(run)
        assert (event["snapshot_timeline"], event["ancestors"]) == (first.timeline, [[first.timeline, 4]])
        assert (run / "group0" / "timeline.json").exists()
    finally:
        restarted.close()
