"""A full disk on one rank fails the save on every rank with that cause, not after the commit
timeout: the failing rank's marker cannot land (its disk is full), so its notice through the
rendezvous store (``storage.notice``) tells the coordinator, which decides at its next poll and
removes the partial attempt (which is what filled the disk); the previous step stays loadable."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tests.dist import outcome, run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _state(value: float) -> dict:
    # Replicated tensors are balanced over the ranks: each writes one; both send receipts.
    return {"a": torch.full((4096,), value), "b": torch.full((4096,), -value), "step": int(value)}


def _full_disk_on_rank_1(rank: int, world: int, root: str) -> dict:
    from resilient import Checkpointer, CheckpointerConfig
    from resilient.storage.objects import FileObjectStore

    ckpt = Checkpointer(root, config=CheckpointerConfig(commit_timeout_s=20.0))
    ckpt.save(1, _state(1.0)).wait(timeout=30)
    if rank == 1:
        # From here rank 1's disk is full: its shard write fails, and so does every later write
        # until something is deleted (the partial attempt is what filled it).
        os.environ["RESILIENT_FAULTS"] = "persist.first_region_issued=enospc@rank1"
        real_write, real_delete, freed = FileObjectStore.write, FileObjectStore.delete_prefix, []

        def write(self, key: str, data: bytes) -> None:
            if not freed:
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(self, key, data)

        def delete_prefix(self, key: str) -> None:
            real_delete(self, key)
            freed.append(key)

        FileObjectStore.write, FileObjectStore.delete_prefix = write, delete_prefix
    ckpt.save(2, _state(2.0))
    result = {"save": outcome(ckpt.wait)}  # agreed: the same outcome on every rank
    os.environ.pop("RESILIENT_FAULTS", None)
    result["steps"] = ckpt.steps()
    target = {"a": torch.zeros(4096), "b": torch.zeros(4096), "step": 0}
    result["loaded"] = [ckpt.load(target), float(target["a"][0])]
    ckpt.close()
    return result


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_at_once(tmp_path) -> None:
    results = run_world(_full_disk_on_rank_1, 2, str(tmp_path))
    said = {r["save"] for r in results}
    assert len(said) == 1, results  # the same error on every rank
    (error,) = said
    # Decided on rank 1's failure marker, not on its missing receipt after the 20 s timeout.
    assert "No space left on device" in error and "rank(s) [1] failed to write" in error, error
    assert all(r["steps"] == [1] and r["loaded"] == [1, 1.0] for r in results), results
    step2 = tmp_path / "step-000000002"
    leftover = [f for _, _, files in os.walk(step2) for f in files if not f.startswith("rank-")]
    assert leftover == [], leftover  # no shard data of the failed attempt (only failure markers)
