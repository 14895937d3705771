"""The launcher behind ``resilient-train --replica-groups``: a lighthouse and one torchrun per
replica group (one torchrun job alone: ``resilient.trainer.launching.torchrun``).

    resilient-train --replica-groups 2 --nproc-per-group 2 --config configs/tiny.toml --set parallel.tp=1

starts ``torchft_lighthouse`` on 127.0.0.1 (unless ``--lighthouse URL`` names a running one), then
one torchrun per group with ``--max-restarts``, its own rendezvous port and the environment the
group needs (``RESILIENT_GROUP``, ``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE``,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it a torchrun restart reuses the dead
incarnation's rendezvous store and the restarted group never joins, pytorch/pytorch#135712).
Across nodes (``--nnodes N --node-rank R``) this node runs groups R, R+N, ... and only node 0 starts
the lighthouse, on ``--rdzv-endpoint HOST:PORT`` (``ReplicaLaunch.lighthouse_at``).
Logs go to ``<run.dir>/logs/``; ranks write their pids to ``<run.dir>/pids/``; rank 0 of each group
appends per-step quorum events to ``<run.dir>/events.jsonl``.

The lighthouse this launcher started is supervised: its pid is in ``<run.dir>/pids/lighthouse``,
and if it dies the launcher starts it again on the same port (events ``lighthouse_exited`` /
``lighthouse_restarted``). Meanwhile the groups block in ``start_quorum`` (``quorum_retries`` > 0,
up to ``quorum_timeout_s``) and then carry on. A new lighthouse has heard no heartbeats, so it
needs a majority of the groups before it grants a quorum (``ReplicaJob._supervise_lighthouse``).

SIGINT / SIGTERM / ``run.preempt_signal`` stop everything this launcher started: each torchrun gets
the signal (SIGTERM for SIGINT) and passes it to its workers, which stop after the same step and
save it (``resilient.trainer.preempt``); after ``--grace-s`` whatever is left is killed
(torchrun's process group, and the workers by their pid files: they run in sessions of their own).
A rank's error that no restart fixes ends every group at once (``ReplicaJob.wait``). Exit status 0
only if every group finished the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

from resilient.errors import ResilientError, disk_full
from resilient.recovery.config import LIGHTHOUSE_ENV
from resilient.recovery.ownership import JOB_ID_ENV, launch_job_id
from resilient.runfiles import (
    GROUP_ENV,
    EventLog,
    lighthouse_pid_path,
    logs_dir,
    pids_dir,
    read_events,
    read_pid_file,
    write_pid_file,
)
from resilient.trainer.launching.lighthouse import (
    RELAX_AFTER_S,
    die_with_parent,
    free_port,
    kill_group,
    signal_group,
    start_lighthouse,
)
from resilient.trainer.launching.preemption import PreemptMark
from resilient.trainer.launching.torchrun import shell_code
from resilient.trainer.observing.quiet import ERROR_EXIT, RUNTIME_EXIT, final_claim_since
from resilient.validate import check_int

FINAL_STOP_S = 15.0
"""How long the groups get to stop once a rank reported an error that no restart fixes."""


@dataclass(kw_only=True, slots=True)
class ReplicaLaunch:
    """What to start: G groups of N ranks running the trainer with these arguments."""

    groups: int
    nproc_per_group: int
    run_dir: str
    trainer_args: list[str]
    """--config / --set arguments for ``python -m resilient.trainer`` (replica keys added here)."""
    lighthouse: str = ""
    max_restarts: int = 3
    join_timeout_ms: int = 2000
    heartbeat_timeout_ms: int = 2000
    grace_s: float = 40.0
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every rank (tests: pacing, fault injection)."""
    launch_id: str = field(default_factory=lambda: f"{os.getpid()}x{int(time.time())}")
    """Part of every group's rendezvous id, so that each launch has run ids of its own: the
    one-error-line claim (``resilient.trainer.observing.quiet``) of an earlier launch never silences this one."""
    nnodes: int = 1
    """Nodes the groups are spread over: group g runs on node g % nnodes (each group on one node)."""
    node_rank: int = 0
    lighthouse_at: str = ""
    """HOST:PORT of the job's lighthouse when the groups span nodes: node 0 starts it there (bound to
    the interface HOST resolves to) unless ``lighthouse`` names a running one. Empty: 127.0.0.1 and a free port."""
    torchrun_flags: list[str] = field(default_factory=list)
    """Extra torchrun flags of every group (``preempt_flags``: the shutdown timeout, the signals)."""

    def __post_init__(self) -> None:
        check_int("--replica-groups", self.groups, 1)
        check_int("--nproc-per-group", self.nproc_per_group, 1)
        check_int("--max-restarts", self.max_restarts, 0)
        check_int("--nnodes", self.nnodes, 1, self.groups)  # every node runs at least one group
        check_int("--node-rank", self.node_rank, 0, self.nnodes - 1)

    def groups_here(self) -> list[int]:
        """The replica groups this node runs."""
        return [group for group in range(self.groups) if group % self.nnodes == self.node_rank]


# -- replica groups --------------------------------------------------------------------------


def group_command(launch: ReplicaLaunch, group: int) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(launch.nproc_per_group),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        f"group{group}-{launch.launch_id}",
        "--max-restarts",
        str(launch.max_restarts),
        "--monitor-interval",
        "0.1",
        *launch.torchrun_flags,
        "-m",
        "resilient.trainer",
        *launch.trainer_args,
        "--set",
        "replica.enabled=true",
        "--set",
        f"replica.groups={launch.groups}",
    ]
    return command


class ReplicaJob:
    """The processes of one replicated job; ``stop()`` leaves none behind."""

    def __init__(self, launch: ReplicaLaunch) -> None:
        self.launch = launch
        self.run_dir = os.path.abspath(launch.run_dir)
        self.log_dir = logs_dir(self.run_dir)
        launch.env.setdefault(JOB_ID_ENV, launch_job_id(launch.lighthouse_at or launch.lighthouse or launch.launch_id))
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_url = launch.lighthouse
        self.lighthouse_port = 0
        self.groups: dict[int, subprocess.Popen] = {}
        self.lighthouse_min_replicas = 1
        self._worker_lost_since: dict[int, float] = {}  # group -> when a worker of it was first seen dead
        self._started_t = time.time()  # events.jsonl also holds earlier runs' events
        self._logs: list[IO[str]] = []
        self.events = EventLog(self.run_dir, enabled=True)
        self.mark = PreemptMark()
        """Set before this launcher signals the groups: their ranks save (``trainer.preempt``)."""

    def _log(self, name: str) -> IO[str]:
        f = open(os.path.join(self.log_dir, name), "a")  # noqa: SIM115 (closed in stop())
        self._logs.append(f)
        return f

    def start(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        os.makedirs(pids_dir(self.run_dir), exist_ok=True)
        if not self.lighthouse_url:
            host, port = ("127.0.0.1", free_port())
            if self.launch.lighthouse_at:
                host, _, given = self.launch.lighthouse_at.rpartition(":")
                port = int(given)
            self.lighthouse_port = port
            self.lighthouse_url = f"http://{host}:{port}"
            if self.launch.node_rank == 0:  # the other nodes' groups wait for it in start_quorum
                start = time.monotonic()
                self._start_lighthouse()
                self.events.write(
                    "lighthouse_started",
                    url=self.lighthouse_url,
                    pid=self.lighthouse.pid,
                    startup_s=round(time.monotonic() - start, 2),
                )
        for group in self.launch.groups_here():
            env = {
                **os.environ,
                **self.launch.env,
                GROUP_ENV: str(group),
                "REPLICA_GROUP_ID": str(group),
                LIGHTHOUSE_ENV: self.lighthouse_url,
                **self.mark.env(),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "PYTHONUNBUFFERED": "1",
            }
            command = group_command(self.launch, group)
            log = self._log(f"group{group}.log")
            self.groups[group] = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),  # as in run(): nothing outlives the launcher
            )
            self.events.write("group_started", group=group, pid=self.groups[group].pid)

    def _start_lighthouse(self, min_replicas: int = 1) -> None:
        self.lighthouse = start_lighthouse(
            self.lighthouse_port,
            self._log("lighthouse.log"),
            join_timeout_ms=self.launch.join_timeout_ms,
            heartbeat_timeout_ms=self.launch.heartbeat_timeout_ms,
            endpoint=self.launch.lighthouse_at,  # other nodes' groups reach it there, nobody else
            min_replicas=min_replicas,
        )
        self.lighthouse_min_replicas = min_replicas
        write_pid_file(lighthouse_pid_path(self.run_dir), self.lighthouse.pid)

    def _supervise_lighthouse(self) -> None:
        """Start our lighthouse again, on the same port, if it died.

        A new lighthouse knows no heartbeats: the first group to ask gets a quorum of itself at
        once (every group it has heard of joined), and a second group asking a moment later, while
        the first trains, can get one of its own: two groups commit the same step apart and never
        heal (seen in test_lighthouse_killed_and_restarted_no_split_brain). So a new lighthouse
        needs a majority of the groups that can ask: two disjoint quorums cannot both hold one.
        On one machine that is a majority of the healthy groups (``_relax_lighthouse`` lowers it
        when one is lost); across nodes this launcher sees only its own groups, so a majority of
        all of them, held until the run ends."""
        if self.lighthouse is None or self.lighthouse.poll() is None:
            self._relax_lighthouse()
            return
        self.events.write("lighthouse_exited", pid=self.lighthouse.pid, code=shell_code(self.lighthouse.returncode))
        askers = len(self._healthy_groups()) if self.launch.nnodes == 1 else self.launch.groups
        self._restart_lighthouse(majority(askers))

    def _restart_lighthouse(self, min_replicas: int) -> None:
        start = time.monotonic()
        try:
            self._start_lighthouse(min_replicas)
        except (OSError, RuntimeError, TimeoutError) as e:
            self.events.write("lighthouse_restart_failed", error=str(e))
            return  # the dead Popen stays: tried again on the next poll
        self.events.write(
            "lighthouse_restarted",
            url=self.lighthouse_url,
            pid=self.lighthouse.pid,
            startup_s=round(time.monotonic() - start, 2),
            min_replicas=self.lighthouse_min_replicas,
        )

    def _relax_lighthouse(self) -> None:
        """A lighthouse needing a majority of N groups stalls the survivors while lost groups cannot
        ask: once a group is lost (its torchrun failed, or it has lost a worker for
        ``RELAX_AFTER_S`` with its torchrun still running: a restart, not a run's end, when workers
        exit and their torchrun follows with 0), start it again needing a majority of the healthy
        groups. The lost groups cannot ask for a quorum meanwhile, so no split, and by the time
        they rejoin the lighthouse has heard the survivors for seconds. Only on one machine."""
        if self.lighthouse is None or self.lighthouse_min_replicas <= 1 or self.launch.nnodes > 1:
            return
        now = time.monotonic()
        lost = []
        for group, proc in self.groups.items():
            if proc.poll() is None and not self._workers_alive(group) and not self._finished(group):
                since = self._worker_lost_since.setdefault(group, now)
            else:
                self._worker_lost_since.pop(group, None)  # back, or its torchrun ended
                since = None
            if (proc.poll() is not None and proc.returncode != 0) or (
                since is not None and now - since >= RELAX_AFTER_S
            ):
                lost.append(group)
        if not lost:
            return
        healthy = [g for g in self._healthy_groups() if g not in lost]
        needed = majority(len(healthy))
        if needed >= self.lighthouse_min_replicas:
            return
        self.events.write("lighthouse_relaxed", pid=self.lighthouse.pid, min_replicas=needed, lost=lost)
        kill_group(self.lighthouse)
        self._restart_lighthouse(needed)

    def _finished(self, group: int) -> bool:
        """The group's workers ended the run (its torchrun exits 0 a moment later): not a loss,
        and restarting the lighthouse then would stall a group still training."""
        return any(
            e["event"] == "done" and e.get("group") == group and e["t"] >= self._started_t
            for e in read_events(self.run_dir)
        )

    def _healthy_groups(self) -> list[int]:
        """Groups whose torchrun runs and whose recorded workers are all alive."""
        return [g for g, proc in self.groups.items() if proc.poll() is None and self._workers_alive(g)]

    def _workers_alive(self, group: int) -> bool:
        folder = pids_dir(self.run_dir)
        prefix = f"group{group}-rank"
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name.startswith(prefix) and ".tmp" not in name:
                pid = read_pid_file(os.path.join(folder, name))
                if pid is not None and not os.path.exists(f"/proc/{pid}"):
                    return False
        return True

    def wait(self, poll_s: float = 0.2) -> int:
        """Until every group's torchrun exits; 0 if all finished, else the first failure's code.

        A rank's error that no restart fixes (a setting, a full disk: ``final_claim_since``) ends the
        whole job at once with its code (2 for a setting, 1 for the machine): its torchrun would
        restart the group into the same error, and the other groups would train on without it, or
        wait for it. They all get SIGTERM (what they have trained is saved, as on a preemption) and
        ``FINAL_STOP_S`` to stop: one whose peer or lighthouse is gone may wait in a quorum that will
        not come, and a save cut short leaves the previous step loadable."""
        final: str | None = None
        while any(p.poll() is None for p in self.groups.values()):
            self._supervise_lighthouse()
            if final is None and (final := final_claim_since(self.run_dir, self._started_t - 1.0)) is not None:
                self.events.write("final_error", error=final)
                self._signal_groups(signal.SIGTERM)
                deadline = time.monotonic() + min(self.launch.grace_s, FINAL_STOP_S)
            if final is not None and time.monotonic() > deadline:
                for proc in self.groups.values():
                    if proc.poll() is None:
                        kill_group(proc)  # the workers by their pid files: stop()
                break
            time.sleep(poll_s)
        codes = {g: shell_code(p.returncode) for g, p in self.groups.items() if p.poll() is not None}
        for group, code in codes.items():
            self.events.write("group_exited", group=group, code=code)
        if final is not None:
            return RUNTIME_EXIT if disk_full(ResilientError(final)) else ERROR_EXIT
        return next((code for code in codes.values() if code != 0), 0)

    def _signal_groups(self, sig: int) -> None:
        self.mark.set()
        for proc in self.groups.values():
            if proc.poll() is None:
                signal_group(proc, sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Pass ``sig`` (a preemption signal: the groups save the step in flight) to every torchrun,
        kill what is left after the grace period, then the lighthouse."""
        self._signal_groups(sig)
        deadline = time.monotonic() + self.launch.grace_s
        for proc in self.groups.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(proc)
        self._kill_stray_workers()
        if self.lighthouse is not None:
            kill_group(self.lighthouse)
        self.events.close()
        self.mark.close()
        for f in self._logs:
            f.close()

    def _kill_stray_workers(self) -> None:
        """Workers left by a torchrun that died hard (they run in sessions of their own); only this
        node's groups: with groups on several nodes the run directory may be shared."""
        folder = pids_dir(self.run_dir)
        mine = tuple(f"group{group}-" for group in self.launch.groups_here())
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if ".tmp" in name or not name.startswith(mine):
                continue
            pid = read_pid_file(os.path.join(folder, name))
            if pid is None:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"resilient.trainer" not in f.read():
                        continue  # the pid was reused by something else
                os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                continue


def majority(groups: int) -> int:
    """Fewest replicas a quorum must hold so that no two disjoint quorums of ``groups`` exist (>= 1)."""
    return groups // 2 + 1


def run_replicated(launch: ReplicaLaunch, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> int:
    """Start the job, wait for it, and stop everything on return, on error or on one of ``signals``
    (each group gets it, or SIGTERM for SIGINT: a preemption, ``resilient.trainer.preempt``)."""
    job = ReplicaJob(launch)
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    try:
        job.start()
        return job.wait()
    except KeyboardInterrupt:
        return 128 + (received[0] if received else signal.SIGINT)
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        # torchrun passes a preemption signal on to its ranks (``preempt_flags``); Ctrl-C stops
        # them as SIGTERM does, saving the step in flight.
        job.stop(signal.SIGTERM if not received or received[0] == signal.SIGINT else received[0])
        for sig, handler in previous.items():
            signal.signal(sig, handler)
