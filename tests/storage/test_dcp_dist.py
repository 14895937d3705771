"""resilient.dcp over real gloo worlds: FSDP2 + AdamW saved by plain DCP calls on 4 ranks (our
planners, DCP's defaults, thread and process async_save, and our Checkpointer), loaded on 3 by
dcp.load and by the Checkpointer; a rank killed during dcp.async_save leaves the previous step."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient import Checkpointer
from resilient.dcp import LoadPlanner, StorageReader
from resilient.manifest import step_dir
from tests.dist import kill_all, run_world, start_world
from tests.storage import dcp_workers

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TENSORS = 5 + 3 * 5  # up.weight, up.bias, down.weight, norm.weight, norm.bias; AdamW: step, exp_avg, exp_avg_sq


@pytest.mark.timeout(420)
def test_fsdp2_saved_on_4_by_dcp_loads_on_3_every_way(tmp_path) -> None:
    url, ref = str(tmp_path / "ck"), str(tmp_path / "ref")
    steps = run_world(dcp_workers.save_four_ways, 4, url, ref, timeout_s=300)
    assert steps == [[1, 2, 3, 4]] * 4
    for step in range(1, 5):  # DCP-written (1-3) or not (4): a receipt per rank but the coordinator
        receipts = sorted(p.name for p in (tmp_path / "ck").glob(f"{step_dir(step)}/attempt-*/receipts/*"))
        assert receipts == [f"rank-{r:05d}.json" for r in (1, 2, 3)], step
    got = run_world(dcp_workers.load_every_way, 3, url, f"{ref}.rank0", timeout_s=300)
    for rank in got:
        for way in ("dcp1", "dcp2", "dcp3", "dcp4", "checkpointer1"):
            checked, extra = rank[way]
            assert checked == TENSORS, way
            assert extra == {"epoch": 3, "tag": "reshard-test"}, way


@pytest.mark.timeout(420)
def test_process_async_save_writes_a_committed_step(tmp_path) -> None:
    url, ref = str(tmp_path / "ck"), str(tmp_path / "ref")
    assert run_world(dcp_workers.process_async_save, 2, url, ref, timeout_s=360) == [0, 1]
    assert Checkpointer(url).steps() == [6]
    got = run_world(dcp_workers.load_step_in_one_process, 0, url, f"{ref}.rank0", 6)
    assert got == [TENSORS]


@pytest.mark.timeout(240)
def test_kill_during_async_save_leaves_previous_step_loadable(tmp_path) -> None:
    url, markers, point = str(tmp_path / "ck"), tmp_path / "faults", "persist.first_region_issued"
    fault = f"{point}=pause:600@rank1"
    procs, _ = start_world(dcp_workers.save_then_async_save, 2, url, fault, env={"RESILIENT_FAULTS_DIR": str(markers)})
    try:
        marker = markers / f"{point}.rank1"
        deadline = time.monotonic() + 150
        while not marker.exists():
            assert time.monotonic() < deadline, "rank 1 never reached the fault point"
            assert all(p.is_alive() for p in procs), "a rank died before the fault point"
            time.sleep(0.1)
        os.kill(int(marker.read_text()), signal.SIGKILL)  # rank 1, by pid, mid-write of step 2
        procs[1].join(timeout=10)
        assert procs[1].exitcode == -signal.SIGKILL
    finally:
        kill_all(procs)
    assert Checkpointer(url).steps() == [1]
    assert (tmp_path / "ck" / "step-000000002").exists()  # the half-written attempt, invisible
    state = {"w0": torch.zeros(1024, 256), "w1": torch.zeros(1024, 256), "meta": {"step": 0}}
    dcp.load(state, storage_reader=StorageReader(url), planner=LoadPlanner())
    assert torch.equal(state["w0"], torch.ones(1024, 256)) and torch.equal(state["w1"], torch.ones(1024, 256))
    assert state["meta"] == {"step": 1}
