"""``--emit slurm|k8s`` give every node's ranks one job secret (before: each node or pod made its
own ``<run.dir>/job.key``, so heals and buddy copies across nodes were refused)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from resilient.trainer.launching.emit import EmitSpec
from resilient.trainer.launching.emit_k8s import k8s_manifest
from resilient.trainer.launching.emit_slurm import slurm_script

pytestmark = pytest.mark.timeout(30)
SPEC = {
    "job_name": "omni",
    "min_nodes": 2,
    "max_nodes": 2,
    "nproc_per_node": 2,
    "trainer_args": ["--config", "c.toml"],
    "run_volume": "runs",
}


def test_every_pod_takes_the_job_secret_from_one_secret():
    manifest = yaml.safe_load(k8s_manifest(EmitSpec(**SPEC)))
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["RESILIENT_JOB_SECRET"]["valueFrom"] == {"secretKeyRef": {"name": "omni-job-secret", "key": "secret"}}
    assert env["RESILIENT_JOB_ID"]["value"] == "omni"
    assert "kubectl create secret generic omni-job-secret" in k8s_manifest(EmitSpec(**SPEC))


def test_every_node_of_an_sbatch_job_shares_one_secret(tmp_path: Path):
    script = slurm_script(EmitSpec(**SPEC))
    line = next(x for x in script.splitlines() if "RESILIENT_JOB_SECRET" in x and x.startswith("export"))
    assert script.index(line) < script.index("srun ")  # srun passes it on to every node
    made = subprocess.run(["bash", "-c", f"{line}; echo $RESILIENT_JOB_SECRET"], capture_output=True, text=True)
    assert len(bytes.fromhex(made.stdout.strip())) == 32
    given = subprocess.run(
        ["bash", "-c", f"{line}; echo $RESILIENT_JOB_SECRET"],
        capture_output=True,
        text=True,
        env={"RESILIENT_JOB_SECRET": "ab" * 16, "PATH": "/usr/bin:/bin"},
    )
    assert given.stdout.strip() == "ab" * 16  # the operator's own wins
