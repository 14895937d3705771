"""One twin cache for every chaos test (scenarios of the same job reuse one fault-free twin), and
stand-in ranks of a two-node group for the tests of node faults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from resilient.chaos.inject import InjectContext
from resilient.recovery.config import RamTierConfig
from resilient.runfiles import pid_path


@pytest.fixture(scope="session")
def twin_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("chaos-twin-cache"))


# Keeps writing into its node's store, as a rank's RAM-tier threads do, until it is stopped.
_WRITER = """
import os, sys, time
store = sys.argv[1]
while True:
    os.makedirs(os.path.join(store, "own"), exist_ok=True)
    with open(os.path.join(store, "own", "slot0.bin"), "wb") as f:
        f.write(b"x" * 4096)
    time.sleep(0.005)
"""


@pytest.fixture
def node(tmp_path: Path):
    """An inject context for group 0 of two one-rank nodes, and ``start_rank(rank, store)``: a
    stand-in rank (a Python whose command line names resilient.trainer, as the injector checks)
    writing into ``store``, recorded as the rank's pid; every one started is killed afterwards."""
    run_dir = str(tmp_path / "run")
    config = SimpleNamespace(
        recovery=RamTierConfig(store_dir=str(tmp_path / "ram"), ranks_per_node=1),
        checkpoint=SimpleNamespace(memory_every=2),
    )
    job = SimpleNamespace(
        run_dir=run_dir,
        chaos_dir=os.path.join(run_dir, "chaos"),
        job=SimpleNamespace(nproc_per_group=2, ranks_per_node=1, replica_groups=1),
    )
    procs = []

    def start_rank(rank: int, store: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, store, "resilient.trainer"])
        procs.append(proc)
        path = pid_path(run_dir, 0, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_text(f"{proc.pid}\n")
        return proc

    ctx = InjectContext(job=job, config=config, proxy=None, job_step=9)  # type: ignore[arg-type]
    yield ctx, start_rank
    for proc in procs:
        proc.kill()
        proc.wait()
