"""One run of a scenario's job through ``resilient-train --replica-groups``, watched from outside.

The launcher runs in a session of its own; everything it starts (lighthouse, torchruns, ranks) is
recorded as it appears (pid and start time, from the pid files and the launcher's process tree),
so that afterwards ``no_orphans`` can tell a leftover process from a recycled pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil

from resilient.chaos.hooks import CHAOS_DIR_ENV, HOOK_PATH, STEP_SLEEP_ENV
from resilient.chaos.scenario import REPO_ROOT, JobSpec
from resilient.runfiles import JsonlTail, chaos_dir, events_path, pids_dir, read_pid_file


def harness_overrides(job: JobSpec, run_dir: str, checkpoint_url: str) -> list[str]:
    """The scenario's --set list plus what the harness needs (run dir, steps, samples, its hook)."""
    hooks = [HOOK_PATH]
    sets = []
    for item in job.set:
        key, _, value = item.partition("=")
        if key.strip() == "run.step_hooks":
            import tomllib

            hooks = [*tomllib.loads(f"v = {value}")["v"], HOOK_PATH]
            continue
        sets.append(item)
    hook_list = "[" + ", ".join(f'"{h}"' for h in hooks) + "]"
    sets += [
        f'run.dir="{run_dir}"',
        f"run.steps={job.steps}",
        "data.log_samples=true",
        f'checkpoint.url="{checkpoint_url}"',
        f"run.step_hooks={hook_list}",
    ]
    if job.ranks_per_node:
        sets.append(f"recovery.ranks_per_node={job.ranks_per_node}")
    return sets


def job_store_root(config: Any, run_dir: str) -> str:
    """The RAM tier's store root as the job resolves it: the launcher and every rank run with
    cwd = REPO_ROOT, so a relative ``recovery.store_dir`` is relative to the repo, not to the harness's cwd."""
    from resilient.recovery.ram import store_root

    return store_root(_repo_relative(config.recovery), run_dir)


def job_node_store_dir(config: Any, run_dir: str, group: int, node: int) -> str:
    """One simulated node's RAM store, resolved as the job does (see ``job_store_root``)."""
    from resilient.recovery.ram import node_store_dir

    return node_store_dir(_repo_relative(config.recovery), run_dir, group, node)


def _repo_relative(recovery: Any) -> Any:
    import dataclasses

    if recovery.store_dir and not os.path.isabs(recovery.store_dir):
        return dataclasses.replace(recovery, store_dir=os.path.join(str(REPO_ROOT), recovery.store_dir))
    return recovery


def load_job_config(job: JobSpec, overrides: list[str]) -> Any:
    """The resolved TrainConfig of the job (recovery store paths, persist_every, ...)."""
    from resilient.trainer.config import load_config

    return load_config(job.config, [*overrides, "replica.enabled=true", f"replica.groups={job.replica_groups}"])


class JobProcess:
    """The launcher subprocess and what it started."""

    def __init__(
        self,
        job: JobSpec,
        run_dir: str,
        overrides: list[str],
        *,
        env: dict[str, str],
        log_path: str,
        step_sleep_s: float,
    ) -> None:
        self.job = job
        self.run_dir = run_dir
        self.chaos_dir = chaos_dir(run_dir)
        os.makedirs(self.chaos_dir, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "resilient.tools.train",
            "--replica-groups",
            str(job.replica_groups),
            "--nproc-per-group",
            str(job.nproc_per_group),
            "--config",
            job.config,
            "--max-restarts",
            str(job.max_restarts),
            *[a for s in overrides for a in ("--set", s)],
        ]
        full_env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            **env,
            CHAOS_DIR_ENV: self.chaos_dir,
            STEP_SLEEP_ENV: str(step_sleep_s),
        }
        full_env.pop("RESILIENT_FAULTS", None)  # armed per group by the hook, never for the whole job
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.t_launch = time.time()
        self.proc = subprocess.Popen(
            command,
            cwd=str(REPO_ROOT),
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.events = JsonlTail(events_path(run_dir))
        self.seen: dict[int, float] = {}
        """pid -> create_time of every process of the job observed so far."""
        self.returncode: int | None = None
        self.t_end: float | None = None
        self.timed_out = False

    def poll(self) -> bool:
        """Refresh events and the process census; True while the launcher runs."""
        self.events.poll()
        self._census()
        if self.proc.poll() is not None and self.returncode is None:
            self.returncode = self.proc.returncode
            self.t_end = time.time()
            self.events.poll()
        return self.returncode is None

    def _census(self) -> None:
        pids = [self.proc.pid]
        folder = pids_dir(self.run_dir)
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if ".tmp" not in name and (pid := read_pid_file(os.path.join(folder, name))) is not None:
                pids.append(pid)
        with contextlib.suppress(psutil.Error):
            pids += [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        for pid in pids:
            if pid not in self.seen:
                with contextlib.suppress(psutil.Error):
                    self.seen[pid] = psutil.Process(pid).create_time()

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM the launcher (it stops what it started), SIGKILL its session if it hangs."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.poll()

    def leftovers(self, wait_s: float = 5.0) -> list[dict[str, Any]]:
        """Processes of this job still alive after the launcher exited (waits a little for stragglers):
        every one the census saw, and every one in the launcher's session (it runs with
        ``start_new_session``, so the session id is its pid), which catches processes that lived
        between two polls and were reparented when their parent died."""
        deadline = time.monotonic() + wait_s
        while True:
            self._session_census()
            alive = []
            for pid, created in self.seen.items():
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append({"pid": pid, "cmdline": " ".join(p.cmdline())[:160]})
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def _session_census(self) -> None:
        for p in psutil.process_iter(["create_time"]):
            if p.pid in self.seen or p.pid == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if os.getsid(p.pid) == self.proc.pid and p.info["create_time"] is not None:
                    self.seen[p.pid] = p.info["create_time"]

    def kill_leftovers(self, leftovers: list[dict[str, Any]]) -> None:
        for item in leftovers:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                p = psutil.Process(item["pid"])
                if abs(p.create_time() - self.seen[item["pid"]]) < 0.01:
                    p.kill()

    def close(self) -> None:
        self._log.close()
