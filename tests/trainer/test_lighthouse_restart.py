"""A restarted lighthouse must not let two replica groups train apart (trainer/launching/launch.py).

A new lighthouse has heard no heartbeats: the first group to ask gets a quorum of itself at once.
The launcher therefore restarts it needing every healthy group, and relaxes to one as soon as a
group loses a worker. These tests run the real ``torchft_lighthouse``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from resilient.runfiles import pid_path, write_pid_file
from resilient.trainer.launching.launch import ReplicaJob, ReplicaLaunch
from resilient.trainer.launching.lighthouse import RELAX_AFTER_S, free_port, kill_group, start_lighthouse

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _ask(url: str, replica: str, timeout_s: float, out: dict) -> None:
    from torchft._torchft import LighthouseClient

    try:
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=10))
        quorum = client.quorum(replica_id=replica, timeout=timedelta(seconds=timeout_s))
        out[replica] = sorted(p.replica_id for p in quorum.participants)
    except Exception as e:  # noqa: BLE001 - the test asserts on what each asker got
        out[replica] = f"error: {e}"


def test_a_fresh_lighthouse_needing_one_replica_grants_a_lone_group_its_own_quorum(tmp_path):
    # The hazard, shown on the real binary: nobody else has heartbeated yet, so "g0" alone is a quorum.
    port = free_port()
    with open(tmp_path / "lh.log", "w") as log:
        proc = start_lighthouse(port, log, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    try:
        got: dict = {}
        _ask(f"http://127.0.0.1:{port}", "g0", 10, got)
        assert got == {"g0": ["g0"]}
    finally:
        kill_group(proc)


def test_a_lighthouse_needing_two_replicas_never_grants_one_alone(tmp_path):
    port = free_port()
    with open(tmp_path / "lh.log", "w") as log:
        proc = start_lighthouse(port, log, join_timeout_ms=2000, heartbeat_timeout_ms=2000, min_replicas=2)
    try:
        url, alone = f"http://127.0.0.1:{port}", {}
        _ask(url, "g0", 3, alone)
        assert alone["g0"].startswith("error:"), alone
        both: dict = {}
        askers = [threading.Thread(target=_ask, args=(url, g, 30, both)) for g in ("g0", "g1")]
        for t in askers:
            t.start()
        for t in askers:
            t.join(timeout=60)
        assert both == {"g0": ["g0", "g1"], "g1": ["g0", "g1"]}
    finally:
        kill_group(proc)


def _supervise_stand_ins(job: ReplicaJob, groups: dict, workers: dict) -> None:
    """Hand the stand-in groups and their recorded workers to ``job`` and start its lighthouse."""
    job.groups = groups
    for g, worker in workers.items():
        write_pid_file(pid_path(job.run_dir, g, 0), worker.pid)
    job.lighthouse_port = free_port()
    job._start_lighthouse()


def _events(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_launcher_restarts_the_lighthouse_needing_every_healthy_group_then_relaxes(tmp_path):
    run_dir = str(tmp_path / "run")
    launch = ReplicaLaunch(groups=2, nproc_per_group=1, run_dir=run_dir, trainer_args=[])
    job = ReplicaJob(launch)
    os.makedirs(job.log_dir, exist_ok=True)
    # Two stand-in groups (torchrun processes: SIGTERM ends one with 0, as a finished run) with one
    # recorded worker each.
    finishes = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(120)"
    groups = {g: subprocess.Popen([sys.executable, "-c", finishes]) for g in (0, 1)}
    workers = {g: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for g in (0, 1)}
    try:
        _supervise_stand_ins(job, groups, workers)
        assert job.lighthouse_min_replicas == 1
        kill_group(job.lighthouse)  # the lighthouse dies
        job._supervise_lighthouse()
        assert job.lighthouse.poll() is None and job.lighthouse_min_replicas == 2
        restarted = [e for e in _events(run_dir) if e["event"] == "lighthouse_restarted"]
        assert [e["min_replicas"] for e in restarted] == [2]
        job._supervise_lighthouse()  # both groups healthy: nothing changes
        assert job.lighthouse_min_replicas == 2
        # The run's end: group 1's worker records "done" and exits; its torchrun lingers past
        # RELAX_AFTER_S, then exits 0. Not a restart: nothing changes.
        job.events.write("done", group=1, step=14)
        workers[1].kill()
        workers[1].wait(timeout=10)
        job._supervise_lighthouse()
        time.sleep(RELAX_AFTER_S + 0.2)
        job._supervise_lighthouse()
        assert job.lighthouse_min_replicas == 2
        groups[1].terminate()
        assert groups[1].wait(timeout=10) == 0
        time.sleep(RELAX_AFTER_S + 0.2)
        job._supervise_lighthouse()
        assert job.lighthouse_min_replicas == 2
        # A restart: group 0 loses its worker and its torchrun stays to start another. The survivors
        # must not wait for it: after RELAX_AFTER_S the lighthouse needs one group again.
        workers[0].kill()
        workers[0].wait(timeout=10)
        job._supervise_lighthouse()
        assert job.lighthouse_min_replicas == 2
        time.sleep(RELAX_AFTER_S + 0.2)
        job._supervise_lighthouse()
        assert job.lighthouse.poll() is None and job.lighthouse_min_replicas == 1
        kinds = [e["event"] for e in _events(run_dir) if e["event"].startswith("lighthouse")]
        assert kinds == ["lighthouse_exited", "lighthouse_restarted", "lighthouse_relaxed", "lighthouse_restarted"]
    finally:
        for proc in [*groups.values(), *workers.values()]:
            proc.kill()
        job.stop()


def test_with_three_groups_a_restarted_lighthouse_needs_a_majority_of_the_healthy_ones(tmp_path):
    # Relaxing to one would let two survivors each get a quorum of itself from a lighthouse that
    # has heard nobody; a majority of the healthy groups never allows two disjoint quorums.
    run_dir = str(tmp_path / "run")
    job = ReplicaJob(ReplicaLaunch(groups=3, nproc_per_group=1, run_dir=run_dir, trainer_args=[]))
    os.makedirs(job.log_dir, exist_ok=True)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    groups = {g: subprocess.Popen(sleeper) for g in range(3)}
    workers = {g: subprocess.Popen(sleeper) for g in range(3)}
    try:
        _supervise_stand_ins(job, groups, workers)
        kill_group(job.lighthouse)
        job._supervise_lighthouse()
        assert job.lighthouse_min_replicas == 2  # a majority of 3 healthy groups
        workers[2].kill()  # group 2 restarts: 2 healthy, a majority of them is still 2
        workers[2].wait(timeout=10)
        job._supervise_lighthouse()
        time.sleep(RELAX_AFTER_S + 0.2)
        job._supervise_lighthouse()
        assert job.lighthouse_min_replicas == 2
        groups[1].kill()  # group 1's torchrun fails: group 0 alone may go on, at once
        groups[1].wait(timeout=10)
        job._supervise_lighthouse()
        assert job.lighthouse.poll() is None and job.lighthouse_min_replicas == 1
        relaxed = [e for e in _events(run_dir) if e["event"] == "lighthouse_relaxed"]
        assert [(e["min_replicas"], sorted(e["lost"])) for e in relaxed] == [(1, [1, 2])]
    finally:
        for proc in [*groups.values(), *workers.values()]:
            proc.kill()
        job.stop()
