"""A training job with one rank slowed from outside (``resilient.chaos.throttle``), for the
straggler tests: the throttle starts once a given step committed and ends after a span of steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.chaos.throttle import DutyCycle
from resilient.runfiles import read_events, read_jsonl, read_pid
from tests.procs import communicate_or_fail, kill_tree

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")


@dataclass
class Throttled:
    events: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    first_step: int = 0
    """The first step the throttle ran in (0: none)."""
    last_step: int = 0
    share: float = 0.0
    err: str = ""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    cleared: list[dict[str, Any]] = field(default_factory=list)


def _committed(run_dir: Path, group: int = 0) -> int:
    """The newest step the group committed (a replica group that joined late starts past 1)."""
    path = run_dir / f"group{group}" / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    try:
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (ValueError, KeyError):  # a line being written: the one before it
        return int(json.loads(lines[-2])["step"]) if len(lines) > 1 else 0


def _wait_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout_s: float, group: int = 0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        done = _committed(run_dir, group)
        if done >= steps:
            return done
        time.sleep(0.01)
    return _committed(run_dir, group)


def throttled_run(
    run_dir: Path,
    steps: int,
    *sets: str,
    rank: int | None = 1,
    after: int = 4,
    span: int = 20,
    duty: float = 0.4,
    group: int = 0,
    groups: int = 1,
    launch: tuple[str, ...] = ("--nproc", "2"),
    faults: str = "",
    timeout_s: float = 240,
) -> Throttled:
    """Train ``steps`` steps; rank ``rank`` of ``group`` (None: nobody) is held stopped ``duty`` of
    the time from the step after ``after`` for ``span`` steps (steps as that group commits them)."""
    command = [sys.executable, "-m", "resilient.tools.train", *launch, "--config", TINY]
    for item in (f'run.dir="{run_dir}"', f"run.steps={steps}", "checkpoint.persist_every=1000", *sets):
        command += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RESILIENT_FAULTS": faults}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = Throttled([], [])
    throttle = None
    try:
        if rank is not None:
            # Every group in the quorum first: replica groups start apart (one may train alone a while).
            for other in range(groups):
                _wait_steps(proc, run_dir, after, timeout_s / 2, other)
            done = _wait_steps(proc, run_dir, after, timeout_s / 2, group)
            pid = read_pid(str(run_dir), group, rank)
            assert pid is not None and proc.poll() is None, f"the job ended or has no rank {rank} pid at step {done}"
            throttle = DutyCycle(pid, duty, seed=rank).start()
            out.first_step = done + 1
            out.last_step = _wait_steps(proc, run_dir, done + span, timeout_s / 2, group)
            throttle.stop()
            out.share = throttle.share()
        _, out.err = communicate_or_fail(proc, timeout_s, str(command))
    finally:
        if throttle is not None:
            throttle.stop()
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, out.err[-4000:]
    out.events = read_events(str(run_dir))
    out.ranks = read_jsonl(str(run_dir / "group0" / "ranks.jsonl"))
    out.stragglers = [e for e in out.events if e["event"] == "straggler"]
    out.cleared = [e for e in out.events if e["event"] == "straggler_cleared"]
    return out
