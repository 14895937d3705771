"""Helpers of the trainer's end-to-end tests: run torchrun jobs of the tiny recipe, fake a crash,
read back what a run logged and saved."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from resilient import Checkpointer
from resilient.runfiles import read_jsonl_by_step
from tests.procs import communicate_or_fail

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
STEPS, STOP_AT = 8, 4
RUN_TIMEOUT_S = 150


def run_job(
    command: list[str], timeout_s: float = RUN_TIMEOUT_S, expect_ok: bool = True
) -> subprocess.CompletedProcess:
    """Run a launcher; on timeout kill it and every process under it (torchrun's workers live in
    sessions of their own, so killing torchrun alone would orphan them)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RESILIENT_GROUP": "0"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = communicate_or_fail(proc, timeout_s, str(command))
    report = f"{command} exited {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    assert (proc.returncode == 0) == expect_ok, report
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def set_args(run_dir: Path, *extra: str) -> list[str]:
    items = [f'run.dir="{run_dir}"', "data.log_samples=true", f"run.steps={STEPS}", *extra]
    return [arg for item in items for arg in ("--set", item)]


def torchrun(nproc: int, run_dir: Path, *extra: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command += ["-m", "resilient.trainer", "--config", TINY, *set_args(run_dir, *extra)]
    return run_job(command, expect_ok=expect_ok)


def crashed_copy(source: Path, target: Path, last_checkpoint: int) -> Path:
    """``source``'s logs and its checkpoints up to ``last_checkpoint``: the directory a crash leaves
    when the steps after that checkpoint ran and were logged but no later checkpoint committed."""
    newer = {f"step-{s:09d}" for s in Checkpointer(str(source / "ckpt")).steps() if s > last_checkpoint}
    shutil.copytree(source / "ckpt", target / "ckpt", ignore=lambda _, names: [n for n in names if n in newer])
    shutil.copytree(source / "group0", target / "group0")
    return target


def logged_steps(run_dir: Path, name: str) -> list[int]:
    """Steps in the order their lines were written (a redone step appears again)."""
    with open(run_dir / "group0" / name) as f:
        return [json.loads(line)["step"] for line in f]


def step_metrics(run_dir: Path) -> dict[int, dict]:
    return read_jsonl_by_step(str(run_dir / "group0" / "metrics.jsonl"))


def step_samples(run_dir: Path) -> dict[int, list[str]]:
    return {s: r["sample_ids"] for s, r in read_jsonl_by_step(str(run_dir / "group0" / "samples.jsonl")).items()}


def load_tensors(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every array of a committed step, in full, loaded by one process with no process group."""
    ckpt = run_dir / "ckpt"
    with open(ckpt / f"step-{step:09d}" / "manifest.json") as f:
        arrays = json.load(f)["arrays"]
    state = {fqn: torch.empty(a["shape"], dtype=getattr(torch, a["dtype"])) for fqn, a in arrays.items()}
    assert Checkpointer(str(ckpt)).load(state, step=step, strict=False) == step
    return state
