"""A rank SIGKILLed in the middle of a save: the previous step loads, the attempt is invisible and
retention removes it after the next commit."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from resilient import Checkpointer
from tests.dist import kill_all, start_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _state(step: int) -> dict:
    # 8 MiB replicated on both ranks: big enough that the plan splits its write across them
    return {"w": torch.full((2048, 1024), float(step)), "step": step}


def two_saves(rank: int, world: int, url: str, point: str) -> None:
    ckpt = Checkpointer(url)
    ckpt.save(1, _state(1)).wait()
    os.environ["RESILIENT_FAULTS"] = f"{point}=pause:600@rank1"
    ckpt.save(2, _state(2)).wait()  # rank 1 pauses there and is killed there


# mid-write; and after every write but before the one durability pass that precedes the receipt
@pytest.mark.parametrize("point", ["persist.first_region_issued", "persist.regions_written"])
def test_sigkill_mid_save_leaves_previous_step_loadable(tmp_path, point):
    url, markers = str(tmp_path / "ck"), tmp_path / "faults"
    procs, _ = start_world(two_saves, 2, url, point, env={"RESILIENT_FAULTS_DIR": str(markers)})
    try:
        marker = markers / f"{point}.rank1"
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline, "rank 1 never reached the fault point"
            assert all(p.is_alive() for p in procs), "a rank died before the fault point"
            time.sleep(0.1)
        os.kill(int(marker.read_text()), signal.SIGKILL)  # rank 1, by pid, mid-write
        procs[1].join(timeout=10)
        assert procs[1].exitcode == -signal.SIGKILL
    finally:
        kill_all(procs)  # the job dies with it, as torchrun would tear the group down

    ckpt = Checkpointer(url, keep_last=1)
    assert ckpt.steps() == [1]
    assert (tmp_path / "ck" / "step-000000002").exists()  # the half-written attempt is there...
    target = {"w": torch.zeros(2048, 1024), "step": 0}
    assert ckpt.load(target) == 1  # ...but invisible
    assert torch.equal(target["w"], torch.full((2048, 1024), 1.0)) and target["step"] == 1
    ckpt.save(3, _state(3)).wait()  # a newer commit: retention removes step 1...
    assert ckpt.steps() == [3]
    # ...but leaves the orphan while it is young: it could be another writer's save in flight
    # (two replica groups persisting one restored step). Once it is old, the next commit removes it.
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-000000002", "step-000000003"]
    (attempt,) = os.listdir(tmp_path / "ck" / "step-000000002")
    hour_ago = f"attempt-{int((time.time() - 3600) * 1000):011x}-{attempt.rsplit('-', 1)[1]}"
    os.rename(tmp_path / "ck" / "step-000000002" / attempt, tmp_path / "ck" / "step-000000002" / hour_ago)
    ckpt.save(4, _state(4)).wait()
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-000000004"]
