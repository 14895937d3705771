"""The fault-free twin: the same job with no faults, cached by what determines its numbers.

The key hashes the recipe's bytes, the job's shape and overrides (not its faults, pacing, storage
or hold step: none changes a number), the source of the packages that compute (resilient/,
storage/, recovery/, trainer/) and of chaos/ (its hook's digest format), the torch and Python
versions and the device type: any of them changing recomputes the twin. The twin always checkpoints to
local disk inside the cache (storage changes no number either). A ``twin.json`` written last marks
a complete twin; a lock file keeps two harnesses from computing the same twin at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from resilient.chaos.job import JobProcess, harness_overrides, job_store_root, load_job_config
from resilient.chaos.scenario import REPO_ROOT, Scenario, stable_hash
from resilient.errors import ConfigError, disk_full
from resilient.runfiles import default_ckpt_url

CACHE_ENV = "RESILIENT_CHAOS_CACHE"
TWIN_DONE = "twin.json"


def default_cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "resilient-chaos")


def check_cache_dir(cache_dir: str) -> None:
    """Create the twin cache and check it takes files: a bad ``--cache`` is known before the job
    starts, not after it ran, as a failed twin_match."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(os.path.join(cache_dir, f".write-check-{os.getpid()}"), "w"):
            pass
        os.remove(os.path.join(cache_dir, f".write-check-{os.getpid()}"))
    except OSError as e:
        if disk_full(e):  # the machine's failure: not a directory to choose
            raise
        raise ConfigError(
            f"twin cache {cache_dir} cannot be written ({e.strerror or e}); pass --cache DIR (or set "
            f"${CACHE_ENV}) with a writable directory"
        ) from e


def code_hash() -> str:
    """The source that computes the twin's numbers, and chaos/ (its hook writes the digests compared)."""
    h = hashlib.sha256()
    for package in ("resilient", "storage", "recovery", "trainer", "chaos"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            h.update(str(path.relative_to(REPO_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def environment_key(scenario: Scenario) -> dict[str, Any]:
    """What outside the code changes the twin's bits: torch and Python versions, and the device the
    job trains on (kernels and reduction orders differ between CPU and CUDA, and between GPU models)."""
    import torch

    config = load_job_config(scenario.job, harness_overrides(scenario.job, "/twin-key", "/twin-key/ckpt"))
    requested = config.run.device
    device = "cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu"
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.get_device_name(0)}"
    return {"torch": torch.__version__, "python": list(sys.version_info[:2]), "device": device}


def twin_hash(scenario: Scenario) -> str:
    return stable_hash({"twin": scenario.twin_key(), "code": code_hash(), "env": environment_key(scenario)})[:20]


def get_twin(scenario: Scenario, cache_dir: str, log: Any = print) -> tuple[str, dict[str, Any]]:
    """(run dir of the twin, its twin.json), computing it unless the cache has it."""
    key = twin_hash(scenario)
    directory = Path(cache_dir) / f"twin-{key}"
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"twin-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = directory / TWIN_DONE
        if done.exists():
            log(f"twin: reusing {directory}")
            return str(directory / "run"), json.loads(done.read_text())
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        log(f"twin: running the fault-free job into {directory}")
        summary = _run_twin(scenario, directory)
        (directory / f"{TWIN_DONE}.tmp").write_text(json.dumps(summary, indent=1))
        os.replace(directory / f"{TWIN_DONE}.tmp", done)
        return str(directory / "run"), summary


def _run_twin(scenario: Scenario, directory: Path) -> dict[str, Any]:
    job = scenario.job
    run_dir = str(directory / "run")
    overrides = harness_overrides(job, run_dir, default_ckpt_url(run_dir))
    start = time.time()
    proc = JobProcess(job, run_dir, overrides, env={}, log_path=str(directory / "launcher.log"), step_sleep_s=0.0)
    try:
        while proc.poll():
            if time.time() - start > job.timeout_s:
                proc.timed_out = True
                proc.stop()
                break
            time.sleep(0.2)
    finally:
        proc.stop()
        proc.kill_leftovers(proc.leftovers(wait_s=2.0))
        proc.close()
        config = load_job_config(job, overrides)
        if config.checkpoint.memory_every:
            shutil.rmtree(job_store_root(config, run_dir), ignore_errors=True)
    if proc.returncode != 0 or proc.timed_out:
        raise RuntimeError(
            f"the fault-free twin failed (exit {proc.returncode}, timed out: {proc.timed_out}); "
            f"see {directory}/launcher.log and {run_dir}/logs"
        )
    return {
        "key": scenario.twin_key(),
        "seconds": round(time.time() - start, 2),
        "run_dir": run_dir,
        "created": time.time(),
    }
