"""The RAM tier end to end: real torchrun jobs of the tiny recipe, real SIGKILLs by pid.

One group of 2 ranks (dp_shard=2, tp=1), each rank its own simulated node
(``recovery.ranks_per_node=1``), a RAM snapshot every 2 steps, a persistent checkpoint only at the
end (or every 4 steps where the test needs a storage fallback). torchrun restarts the group after
a kill (``--max-restarts 1``). A fault-free twin of the same job is the reference: a faulted run
must end with the same losses, samples and final tensors, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram import node_store_dir, store_root
from resilient.runfiles import read_events, read_jsonl_by_step, read_pid
from tests.procs import communicate_or_fail
from tests.recovery.ram import workers as ram_workers
from tests.trainer.e2e_runs import load_tensors

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
STEPS = 12
RUN_TIMEOUT_S = 150
HOOK = "tests.recovery.ram_hooks:pace"


def _command(run_dir: Path, store: Path, nproc: int, *extra: str) -> list[str]:
    sets = [
        f'run.dir="{run_dir}"',
        f"run.steps={STEPS}",
        "parallel.tp=1",
        f"parallel.dp_shard={nproc}",
        "data.log_samples=true",
        "checkpoint.memory_every=2",
        "checkpoint.persist_every=100",
        "recovery.ranks_per_node=1",
        f'recovery.store_dir="{store}"',
        f'run.step_hooks=["{HOOK}"]',
        "run.log_every=1000",
        *extra,
    ]
    command = [sys.executable, "-m", "resilient.tools.train", "--nproc", str(nproc), "--max-restarts", "1"]
    return command + ["--config", TINY, *[a for s in sets for a in ("--set", s)]]


def _start(command: list[str], step_sleep: float = 0.0) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "RESILIENT_GROUP": "0",
        "RESILIENT_TEST_STEP_SLEEP": str(step_sleep),
    }
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> str:
    out, _ = communicate_or_fail(proc, timeout_s)
    assert proc.returncode == 0, f"launcher exited {proc.returncode}\n{out[-6000:]}"
    return out


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    path = run_dir / "group0" / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the fault"
        if path.exists() and max(read_jsonl_by_step(str(path)) or [0]) >= step:
            return
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {timeout_s} s")


def _restores(run_dir: Path) -> list[dict]:
    return [e for e in read_events(str(run_dir)) if e["event"] == "restore"]


def _assert_same_as_twin(run_dir: Path, twin: Path) -> None:
    """Losses of every step, every step's samples, and the final tensors equal the twin's, bit for bit."""
    ran, ref = (read_jsonl_by_step(str(d / "group0" / "metrics.jsonl")) for d in (run_dir, twin))
    assert list(ran) == list(ref) == list(range(1, STEPS + 1))
    assert [ran[s]["loss"] for s in ran] == [ref[s]["loss"] for s in ref]
    samples, ref_samples = (read_jsonl_by_step(str(d / "group0" / "samples.jsonl")) for d in (run_dir, twin))
    assert {s: r["sample_ids"] for s, r in samples.items()} == {s: r["sample_ids"] for s, r in ref_samples.items()}
    expected, got = load_tensors(twin, STEPS), load_tensors(run_dir, STEPS)
    assert sorted(got) == sorted(expected) and any(k.startswith("optim.state.") for k in got)
    for fqn, tensor in expected.items():
        assert torch.equal(got[fqn], tensor), fqn


def _kill_node(run_dir: Path, store: Path, rank: int, *, wipe: list[int], damage_copies_on: int | None = None) -> None:
    """SIGKILL ``rank``; first, while it is stopped (it cannot write nor send a copy), wipe the
    given nodes' stores and damage every copy of its snapshots kept on node ``damage_copies_on``."""
    pid = read_pid(str(run_dir), 0, rank)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    config = RamTierConfig(store_dir=str(store), ranks_per_node=1)
    for node in wipe:
        shutil.rmtree(node_store_dir(config, str(run_dir), 0, node))
    if damage_copies_on is not None:
        assert ram_workers.corrupt_kept_copies(str(store), str(run_dir), rank, node=damage_copies_on)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("twin")
    _finish(_start(_command(root / "run", root / "store", 2)))
    return root / "run"


def _faulted(
    tmp_path: Path, wipe: list[int], extra: tuple[str, ...] = (), damage_copies_on: int | None = None
) -> tuple[Path, Path, list[dict]]:
    run_dir, store = tmp_path / "run", tmp_path / "store"
    proc = _start(_command(run_dir, store, 2, *extra), step_sleep=0.3)
    try:
        _wait_for_step(run_dir, 5, proc)
        _kill_node(run_dir, store, 1, wipe=wipe, damage_copies_on=damage_copies_on)
    finally:
        tmp_path.joinpath("out.txt").write_text(_finish(proc))
    restores = _restores(run_dir)
    assert len(restores) == 4, restores  # the first start and the restart, two ranks each
    assert {(r["rank"], r["source"]) for r in restores[:2]} == {(0, "fresh"), (1, "fresh")}
    return run_dir, store, sorted(restores[2:], key=lambda r: r["rank"])


@pytest.mark.timeout(400)
def test_rank_killed_restores_from_own_node_store_without_storage(tmp_path: Path, twin: Path) -> None:
    run_dir, _, restarted = _faulted(tmp_path, wipe=[])
    assert [r["source"] for r in restarted] == ["own", "own"]
    assert restarted[0]["step"] == restarted[1]["step"] >= 4 and restarted[0]["step"] % 2 == 0
    assert [r["storage_reads"] for r in restarted] == [0, 0] and all(r["bytes"] > 0 for r in restarted)
    _assert_same_as_twin(run_dir, twin)


@pytest.mark.timeout(400)
def test_node_lost_its_ranks_restore_from_the_buddy(tmp_path: Path, twin: Path) -> None:
    run_dir, _, restarted = _faulted(tmp_path, wipe=[1])
    assert [r["source"] for r in restarted] == ["own", "buddy"]
    assert restarted[0]["step"] == restarted[1]["step"] >= 4
    assert [r["storage_reads"] for r in restarted] == [0, 0]
    # Before and after the restart, every snapshot taken reached its buddy (or a newer one did).
    with open(run_dir / "group0" / "ram.jsonl") as f:
        outcomes = [json.loads(line)["replication"]["outcome"] for line in f if '"replication"' in line]
    assert outcomes and set(outcomes) <= {"copied", "superseded"} and outcomes.count("copied") >= len(outcomes) // 2
    _assert_same_as_twin(run_dir, twin)


@pytest.mark.timeout(400)
def test_pipelined_node_lost_its_stage_restores_from_the_buddy(tmp_path: Path, twin: Path) -> None:
    """pp=2: each rank (its own node) holds one stage; the node of stage 1 loses its store, and its
    rank restores that stage's snapshot from the buddy. The twin ran pp=1 x dp_shard=2 on the same
    data: the same samples, losses equal up to the order of float sums."""
    pipelined = ("parallel.pp=2", "parallel.dp_shard=1", "model.n_layers=2")
    run_dir, _, restarted = _faulted(tmp_path, wipe=[1], extra=pipelined)
    assert [r["source"] for r in restarted] == ["own", "buddy"]
    assert restarted[0]["step"] == restarted[1]["step"] >= 4
    assert [r["storage_reads"] for r in restarted] == [0, 0]
    # A stage's snapshot holds that stage's parameters only: the two ranks restore different bytes.
    assert restarted[0]["bytes"] != restarted[1]["bytes"]
    ran, ref = (read_jsonl_by_step(str(d / "group0" / "metrics.jsonl")) for d in (run_dir, twin))
    assert list(ran) == list(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert abs(ran[step]["loss"] - ref[step]["loss"]) < 1e-4, step
    samples, ref_samples = (read_jsonl_by_step(str(d / "group0" / "samples.jsonl")) for d in (run_dir, twin))
    assert {s: r["sample_ids"] for s, r in samples.items()} == {s: r["sample_ids"] for s, r in ref_samples.items()}


@pytest.mark.timeout(400)
def test_a_ram_restore_undone_puts_the_initial_state_back_and_trains_as_a_fresh_start(
    tmp_path: Path, twin: Path
) -> None:
    # No committed step: the restart's RAM restore goes straight into the live model and optimizer.
    # Rank 1's node is lost and every copy of its snapshots on node 0 is damaged, so rank 1's
    # fetches fail after rank 0's own snapshot (and rank 1's bad copy) landed in their tensors:
    # both put the step-0 state back (the trainer's reinit), and the fresh start trains bit for
    # bit as the twin.
    run_dir, _, restarted = _faulted(tmp_path, wipe=[1], damage_copies_on=0)
    assert [(r["source"], r["step"]) for r in restarted] == [("fresh", 0), ("fresh", 0)]
    assert any("crc32c mismatch" in e["reason"] for e in restarted[1]["excluded"])
    out = (tmp_path / "out.txt").read_text()
    assert all(f"[rank {rank}] no RAM step restored: putting the initial state back" in out for rank in (0, 1)), out
    _assert_same_as_twin(run_dir, twin)


@pytest.mark.timeout(400)
def test_node_and_its_buddy_lost_fall_back_to_storage_exactly_once(tmp_path: Path, twin: Path) -> None:
    run_dir, _, restarted = _faulted(tmp_path, wipe=[0, 1], extra=("checkpoint.persist_every=4",))
    assert [r["source"] for r in restarted] == ["persistent", "persistent"]
    assert restarted[0]["step"] == 4 and all(r["storage_reads"] > 0 for r in restarted)
    _assert_same_as_twin(run_dir, twin)


@pytest.mark.timeout(300)
def test_other_world_size_restores_from_storage(tmp_path: Path, twin: Path) -> None:
    # The twin's run (RAM snapshots of 2 ranks, final checkpoint at step 12) continued on ONE rank.
    run_dir = tmp_path / "run"
    shutil.copytree(twin, run_dir)
    store = tmp_path / "store"
    # The store is keyed by run.dir: the twin's, moved under this run's key.
    twin_store = store_root(RamTierConfig(store_dir=str(twin.parent / "store")), str(twin))
    shutil.copytree(twin_store, store_root(RamTierConfig(store_dir=str(store)), str(run_dir)))
    out = _finish(_start(_command(run_dir, store, 1, f"run.steps={STEPS + 2}")))
    restored = _restores(run_dir)[-1]
    assert (restored["source"], restored["step"]) == ("persistent", STEPS), out[-2000:]
    assert any("another topology" in e["reason"] for e in restored["excluded"])
