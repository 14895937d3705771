"""``--emit k8s|slurm`` give every node one run directory (the job record, events, the group's
timeline): a JobSet mounts a ReadWriteMany claim for it in every pod, or is refused naming
``--run-volume``; an sbatch job refuses a node-local run.dir, and each node checks before it starts
that it sees the file the batch shell wrote there (before: each pod kept run.dir inside its
container, lost when rank 0's pod restarted)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from resilient.errors import ConfigError
from resilient.tools.train import main
from resilient.trainer.launching.emit import EmitSpec
from resilient.trainer.launching.emit_slurm import slurm_script
from tests.trainer.emit_helpers import SPEC, TINY, stub, stubs, trainer_container

pytestmark = pytest.mark.timeout(60)
S3 = ["--set", "checkpoint.url=s3://bucket/omni"]


def test_k8s_without_a_run_volume_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--emit", "k8s", "--config", TINY, "--image", "i:1", *S3]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "--run-volume CLAIM" in line and "ReadWriteMany" in line and "/resilient/runs/resilient" in line


def test_k8s_mounts_the_claim_in_every_pod_and_points_run_dir_into_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--emit", "k8s", "--config", TINY, "--image", "i:1", *S3, "--run-volume", "team-runs", "--job-name", "omni"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    container = trainer_container(yaml.safe_load(out))
    claim = {"name": "runs", "persistentVolumeClaim": {"claimName": "team-runs"}}
    assert claim in container["pod"]["volumes"]
    assert {"name": "runs", "mountPath": "/resilient/runs"} in container["volumeMounts"]
    command = container["args"][0].splitlines()[-1]
    # The pods' run.dir is on the claim, after the recipe's; the file says it replaces the recipe's.
    assert command.endswith(
        "--config " + TINY + " --set checkpoint.url=s3://bucket/omni --set run.dir=/resilient/runs/omni"
    )
    assert "# run.dir is /resilient/runs/omni, in place of the recipe's runs/tiny." in out
    with pytest.raises(ConfigError, match="--run-volume 'Team_Runs' must be a PersistentVolumeClaim name"):
        EmitSpec(**SPEC, run_volume="Team_Runs")


def test_k8s_refuses_a_run_dir_of_the_user_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # Before, the manifest's own --set after it silently replaced it.
    argv = ["--emit", "k8s", "--config", TINY, "--image", "i:1", *S3, "--run-volume", "team-runs", "--job-name", "omni"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--set", " run.dir =runs/elsewhere"])
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == ""
    assert captured.err.splitlines()[-1].startswith(
        "resilient-train: error: --emit k8s mounts --run-volume at /resilient/runs, run.dir=/resilient/runs/omni: "
        "drop --set run.dir"
    )


@pytest.mark.parametrize("run_dir", ["/tmp/runs/omni", "/dev/shm/omni", "/var/tmp"])
def test_slurm_refuses_a_node_local_run_dir(run_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--emit", "slurm", "--config", TINY, "--set", f"run.dir={run_dir}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"run.dir={run_dir} is under" in line and "every node mounts" in line


def test_slurm_refuses_a_run_volume(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--emit", "slurm", "--config", TINY, "--run-volume", "runs"])
    assert exited.value.code == 2 and "--run-volume is for --emit k8s" in capsys.readouterr().err


def _sbatch(tmp_path: Path, srun: str | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sbatch"
    path.write_text(slurm_script(EmitSpec(**SPEC, min_nodes=2, max_nodes=2, run_dir="runs/omni")))
    env = {**stubs(tmp_path), "SLURM_JOB_ID": "51", "SLURM_JOB_NODELIST": "n[1-2]"}
    if srun is not None:
        stub(tmp_path / "bin", "srun", srun)
    return subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)


def test_sbatch_nodes_that_share_run_dir_start_and_the_mark_is_removed(tmp_path: Path) -> None:
    done = _sbatch(tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.glob("node-*")) == ["node-gpu-a17", "node-gpu-a18"]
    assert (tmp_path / "runs" / "omni").is_dir() and list((tmp_path / "runs" / "omni").iterdir()) == []


def test_sbatch_node_that_does_not_see_run_dir_stops_in_one_line(tmp_path: Path) -> None:
    # Node 1 runs elsewhere: its relative run.dir is another directory, as a node-local one would be.
    srun = (
        "while [[ $1 == --* ]]; do shift; done\n"
        "for n in 0 1; do\n"
        "  (if [ $n = 1 ]; then mkdir -p elsewhere && cd elsewhere; fi\n"
        '   SLURM_NODEID=$n SLURMD_NODENAME=gpu-a1$((7 + n)) "$@") || exit\n'
        "done\n"
    )
    done = _sbatch(tmp_path, srun)
    assert done.returncode == 2
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "run.dir runs/omni on" in line and "every node mounts" in line
    assert [p.name for p in tmp_path.glob("node-*")] == ["node-gpu-a17"]  # node 1 never started
