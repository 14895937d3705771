"""trainer/launching/emit.py: ``resilient-train --emit slurm|k8s`` prints files that parse and that start one
``resilient-train`` per node with the multi-node flags. The emitted scripts are run here with stub
``srun`` / ``scontrol`` / ``resilient-train`` on PATH: what each node would execute is asserted."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from resilient.errors import ConfigError
from resilient.tools.train import main
from resilient.trainer.launching.emit import EmitSpec
from resilient.trainer.launching.emit_k8s import k8s_manifest
from resilient.trainer.launching.emit_slurm import slurm_script
from tests.trainer.emit_helpers import REPO, SPEC, TINY, stub, stubs, trainer_container

pytestmark = pytest.mark.timeout(60)

K8S = ["--image", "i:1", "--set", "checkpoint.url=s3://bucket/omni", "--run-volume", "omni-runs"]
"""What every k8s emit needs: an image, checkpoints that outlive the pods, and a run.dir volume."""


def _recorded(tmp_path: Path, node: str) -> tuple[str, list[str]]:
    node_id, *argv = (tmp_path / f"node-{node}").read_text().splitlines()
    return node_id, argv


def _recorded_by_rank(tmp_path: Path, node_rank: str) -> tuple[str, list[str]]:
    """The launcher line recorded for ``--node-rank node_rank`` (files are named by node id)."""
    for path in tmp_path.glob("node-*"):
        node_id, *argv = path.read_text().splitlines()
        if "--node-rank" in argv and _flag(argv, "--node-rank") == node_rank:
            return node_id, argv
    raise AssertionError(f"no launcher recorded --node-rank {node_rank}")


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sbatch_script_parses_and_starts_one_launcher_per_node(tmp_path: Path) -> None:
    script = slurm_script(EmitSpec(**SPEC, min_nodes=2, max_nodes=2))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for wanted in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--requeue", "--job-name=omni"):
        assert f"#SBATCH {wanted}" in directives, directives
    assert "/dev/shm" in script and "32Gi" in script  # the note and the per-node check
    env = {**stubs(tmp_path), "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NODELIST": "gpu-a[17-18]"}
    done = subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    for node, host in (("0", "gpu-a17"), ("1", "gpu-a18")):
        node_id, argv = _recorded_by_rank(tmp_path, node)
        assert node_id == host  # the machine's name (SLURMD_NODENAME), never its position SLURM_NODEID
        assert _flag(argv, "--node-rank") == node and _flag(argv, "--nnodes") == "2"
        assert _flag(argv, "--rdzv-endpoint") == "gpu-a17:29400"  # the allocation's first node
        assert _flag(argv, "--rdzv-id") == "4242-1"  # new for each requeue of the job
        assert _flag(argv, "--nproc-per-node") == "4" and _flag(argv, "--max-restarts") == "3"
        assert argv[-4:] == ["--config", "r.toml", "--set", "run.preempt_signal=SIGUSR1"]


def test_sbatch_script_elastic_and_cpu(tmp_path: Path) -> None:
    spec = EmitSpec(**{**SPEC, "gpus_per_node": 0}, min_nodes=2, max_nodes=4)
    script = slurm_script(spec)
    assert "#SBATCH --nodes=2-4" in script and "--gpus-per-node" not in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**stubs(tmp_path), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert (
        subprocess.run(
            ["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
        ).returncode
        == 0
    )
    _, argv = _recorded(tmp_path, "gpu-a18")  # the second node's machine name (the srun stub's)
    assert _flag(argv, "--nnodes") == "2:4" and "--node-rank" not in argv  # elastic: ranked at rendezvous
    assert _flag(argv, "--rdzv-id") == "7-0"


def test_sbatch_script_for_replica_groups_spreads_them_over_the_nodes(tmp_path: Path) -> None:
    spec = EmitSpec(**{**SPEC, "gpus_per_node": 8, "nproc_per_node": 8}, replica_groups=4, nproc_per_group=4)
    script = slurm_script(spec)
    assert "lighthouse lives on the allocation's first node" in script
    assert "--kill-on-bad-exit=0" in script  # a node's groups may die; the others train on
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**stubs(tmp_path), "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu-a[17-18]"}
    assert (
        subprocess.run(
            ["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
        ).returncode
        == 0
    )
    for node in ("0", "1"):
        _, argv = _recorded_by_rank(tmp_path, node)
        assert (_flag(argv, "--replica-groups"), _flag(argv, "--nproc-per-group")) == ("4", "4")
        assert (_flag(argv, "--nnodes"), _flag(argv, "--node-rank")) == ("2", node)
        assert _flag(argv, "--rdzv-endpoint") == "gpu-a17:29400"  # node 0 starts the lighthouse there
        assert "--rdzv-id" not in argv and "--nproc-per-node" not in argv  # each group meets on its node
    with pytest.raises(ConfigError, match="--replica-groups 3 over --nnodes 2"):
        EmitSpec(**SPEC, replica_groups=3, nproc_per_group=4)
    with pytest.raises(ConfigError, match="--replica-groups 4 over --nnodes 2:4"):
        EmitSpec(**SPEC, replica_groups=4, nproc_per_group=4, min_nodes=2, max_nodes=4)


def test_cli_emits_replica_groups(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--emit", "k8s", "--config", TINY, "--replica-groups", "4", "--nproc-per-group", "4", "--nnodes", "2", *K8S]
    assert main([*argv, "--set", "data.global_rows=24"]) == 0
    container = trainer_container(yaml.safe_load(capsys.readouterr().out))
    command = shlex.split(container["args"][0].splitlines()[-1].removeprefix("exec "))
    assert _flag(command, "--rdzv-endpoint") == "resilient-node-0-0.resilient:29400"
    assert (_flag(command, "--replica-groups"), _flag(command, "--node-rank")) == ("4", "$JOB_COMPLETION_INDEX")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8  # 2 groups x 4 ranks on each node
    assert "replica.enabled=true" not in command  # the launcher adds the replica keys itself


def test_k8s_manifest_is_a_jobset_with_shm_restart_policy_and_rendezvous(tmp_path: Path) -> None:
    manifest = yaml.safe_load(
        k8s_manifest(EmitSpec(**SPEC, min_nodes=3, max_nodes=3, image="reg/omni:7", run_volume="runs"))
    )
    assert (manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"]) == (
        "jobset.x-k8s.io/v1alpha2",
        "JobSet",
        "omni",
    )
    assert manifest["spec"]["network"]["enableDNSHostnames"] is True
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 3
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (3, 3, "Indexed")
    container = trainer_container(manifest)
    pod = container["pod"]
    assert pod["restartPolicy"] == "OnFailure"
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}},
    ]
    assert container["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "runs", "mountPath": "/resilient/runs"},
    ]
    assert container["image"] == "reg/omni:7" and container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["ports"] == [{"containerPort": 29400}]
    env = {e["name"]: e for e in container["env"]}
    assert env["RDZV_ID"]["value"] == "omni-$(RESTART_ATTEMPT)"  # new for each JobSet restart
    restart = env["RESTART_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert restart == "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
    # What pod 2 runs: the container's script with a stub resilient-train.
    assert container["command"] == ["bash", "-c"]
    run_env = {**stubs(tmp_path), "JOB_COMPLETION_INDEX": "2", "RDZV_ID": "omni-0"}
    run_env["RESILIENT_NODE_ID"] = "omni-node-0-2"  # as an operator may pin it; else the hostname
    done = subprocess.run(["bash", "-c", *container["args"]], env=run_env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    node_id, argv = _recorded(tmp_path, "omni-node-0-2")
    assert node_id == "omni-node-0-2"
    assert _flag(argv, "--rdzv-endpoint") == "omni-node-0-0.omni:29400"  # pod 0's stable DNS name
    assert (_flag(argv, "--node-rank"), _flag(argv, "--rdzv-id"), _flag(argv, "--nnodes")) == ("2", "omni-0", "3")
    assert _flag(argv, "--nproc-per-node") == "4"
    assert argv[-4:] == ["--config", "r.toml", "--set", "run.dir=/resilient/runs/omni"]  # on the claim


def test_k8s_node_identity_defaults_to_the_pod_hostname(tmp_path: Path) -> None:
    manifest = yaml.safe_load(k8s_manifest(EmitSpec(**{**SPEC, "gpus_per_node": 0}, run_volume="runs")))
    container = trainer_container(manifest)
    assert "nvidia.com/gpu" not in str(container["resources"])  # a CPU recipe requests no GPU
    env = {k: v for k, v in stubs(tmp_path).items() if k != "RESILIENT_NODE_ID"}
    env.update(JOB_COMPLETION_INDEX="0", RDZV_ID="omni-0")
    done = subprocess.run(["bash", "-c", *container["args"]], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    hostname = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    assert _recorded(tmp_path, hostname)[0] == hostname


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"job_name": "Omni_Run"}, "--job-name 'Omni_Run'"),
        ({"shm_size": "64G"}, "--shm-size '64G'"),
        ({"rdzv_port": 0}, "--rdzv-port 0"),
        ({"gpus_per_node": -1}, "--gpus-per-node -1"),
        ({"time_limit": "24h"}, "--time '24h'"),
        ({"cpus_per_node": -1}, "--cpus-per-node -1"),
        ({"mem_per_node": "512G"}, "--mem-per-node '512G'"),
    ],
)
def test_emit_spec_rejects_bad_values_naming_the_flag(change: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        EmitSpec(**{**SPEC, **change})


def test_cli_emits_from_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    # tiny.toml: dp_shard 2 x tp 2 = 4 ranks, split over the default 2 nodes; device auto: GPUs.
    assert main(["--emit", "k8s", "--config", TINY, *K8S, "--set", "run.steps=20"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    container = trainer_container(manifest)
    command = container["args"][0].splitlines()[-1]
    argv = shlex.split(command.removeprefix("exec "))
    assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--nproc-per-node") == "2"
    assert argv[-6:-2] == ["--set", "checkpoint.url=s3://bucket/omni", "--set", "run.steps=20"]
    assert argv[-2:] == ["--set", "run.dir=/resilient/runs/resilient"]  # after the recipe's: it wins
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert main(["--emit", "slurm", "--config", TINY, "--nnodes", "4", "--set", "parallel.dp_shard=4"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=4" in script and "--nproc-per-node 2" in script


def _one_line_exit_2(argv: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "resilient.tools.train", *argv], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    return lines[0]


EMIT_GROUPS = ["--emit", "k8s", "--config", TINY, *K8S, "--replica-groups", "2"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--emit", "slurm"], "resilient-train: error: --emit takes --config RECIPE"),
        (["--emit", "k8s", "--config", TINY, "--node-rank", "1"], "error: --emit writes --node-rank for each node"),
        (["--emit", "k8s", "--config", TINY, "--rdzv-id", "x"], "error: --emit writes --rdzv-id"),
        (["--emit", "slurm", "--config", TINY, "--nnodes", "2:x"], "error: --nnodes '2:x' must be N or MIN:MAX"),
        (["--emit", "mpi", "--config", TINY], "argument --emit: invalid choice: 'mpi'"),
        (["--emit", "slurm", "--config", TINY, "--nnodes", "3"], "error: parallel.pp x dp_shard x tp = 4 ranks"),
        (["--emit", "k8s", "--config", TINY, *K8S, "--nproc-per-node", "4"], "error: --nnodes 2 x --nproc-per-node 4"),
        (["--emit", "k8s", "--config", TINY, *K8S, "--shm-size", "1GB"], "error: --shm-size '1GB'"),
        # Not ready to submit: a placeholder image, checkpoints on the pods' own disks, a bad limit.
        (["--emit", "k8s", "--config", TINY], "--emit k8s takes --image IMAGE"),
        (["--emit", "k8s", "--config", TINY, "--image", "i:1"], "checkpoint.url=s3://BUCKET/PREFIX"),
        (["--emit", "slurm", "--config", TINY, "--time", "1 day"], "--time '1 day' must be [DAYS-]HH:MM:SS"),
        (
            [*EMIT_GROUPS, "--nproc-per-group", "2"],
            "error: --nproc-per-group 2 but parallel.pp x dp_shard x tp = 4 ranks",
        ),
        ([*EMIT_GROUPS, "--nproc-per-group", "4", "--nproc-per-node", "8"], "not --nproc-per-node"),
        # Flags the job file would silently drop, and a value that would break out of it.
        (["--emit", "k8s", "--config", TINY, "--lighthouse", "http://h:1"], "does not write --lighthouse"),
        (["--emit", "slurm", "--config", TINY, "--grace-s", "5"], "does not write --grace-s"),
        (["--emit", "k8s", "--config", TINY, "--set", "run.dir=a\n  hostNetwork: true"], "control character"),
    ],
)
def test_bad_emit_flags_are_one_line_exit_2(argv: list[str], says: str) -> None:
    assert says in _one_line_exit_2(argv)


def _preempt_stubs(tmp_path: Path) -> dict[str, str]:
    """An ``srun`` that runs until it gets SIGUSR1, then exits 143 as a preempted launcher does (it
    says it got the signal), and an ``scontrol`` that records a requeue."""
    env = stubs(tmp_path)
    bin_dir = tmp_path / "bin"
    body = (
        'trap \'echo "step got USR1" >> "$OUT/log"; exit 143\' USR1\n'
        'trap \'echo "step got TERM" >> "$OUT/log"; exit 143\' TERM\n'
        'echo started >> "$OUT/log"\n'
        "for i in $(seq 1 300); do sleep 0.1; done\nexit 0\n"
    )
    stub(bin_dir, "srun", body)
    stub(bin_dir, "scontrol", 'if [ "$1" = requeue ]; then echo "requeue $2" >> "$OUT/log"; else echo n1; fi\n')
    return env


def _start_preemptible_sbatch(tmp_path: Path, script: str, *, job_id: str) -> tuple[subprocess.Popen, Path]:
    """The batch script running under the preemption stubs, once its step has started (and the
    log the stubs write), so that a test can signal it as SLURM would."""
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**_preempt_stubs(tmp_path), "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "n[1-2]"}
    job = subprocess.Popen(
        ["bash", str(path)], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    log = tmp_path / "log"
    for _ in range(100):
        if log.exists() and "started" in log.read_text():
            break
        subprocess.run(["sleep", "0.1"], check=True)
    return job, log


def test_sbatch_asks_for_the_signal_ahead_of_the_limit_and_requeues_when_preempted(tmp_path: Path) -> None:
    spec = EmitSpec(**SPEC, min_nodes=2, max_nodes=2, preempt_grace_s=100.0)
    script = slurm_script(spec)
    assert "#SBATCH --signal=B:USR1@170" in script  # grace + torchrun's and the launcher's margins + 30
    job, log = _start_preemptible_sbatch(tmp_path, script, job_id="77")
    job.send_signal(10)  # SIGUSR1, as SLURM sends it to the batch shell (B:)
    _, stderr = job.communicate(timeout=30)
    assert job.returncode == 143, stderr
    assert log.read_text().splitlines() == ["started", "step got USR1", "requeue 77"]
    assert "requeueing job 77" in stderr


def test_sbatch_passes_sigterm_on_to_the_step_and_waits_for_it(tmp_path: Path) -> None:
    # scancel, a preemption or the time limit: SLURM sends SIGTERM, then SIGKILL after KillWait.
    script = slurm_script(EmitSpec(**SPEC, min_nodes=2, max_nodes=2, preempt_grace_s=100.0))
    job, log = _start_preemptible_sbatch(tmp_path, script, job_id="79")
    job.send_signal(15)
    _, stderr = job.communicate(timeout=30)
    assert job.returncode == 143, stderr
    assert log.read_text().splitlines() == ["started", "step got TERM"]  # SLURM requeues itself, if it does


def test_sbatch_does_not_requeue_a_job_that_ended(tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(slurm_script(EmitSpec(**SPEC, min_nodes=2, max_nodes=2)))
    env = {**stubs(tmp_path), "SLURM_JOB_ID": "78", "SLURM_JOB_NODELIST": "n[1-2]"}
    done = subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "requeue" not in done.stderr, done.stderr


def test_jobset_grace_period_covers_the_trainers_preemption_grace() -> None:
    manifest = yaml.safe_load(k8s_manifest(EmitSpec(**SPEC, preempt_grace_s=300.0, run_volume="runs")))
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 370 > 300 + 30  # above the grace and torchrun's margin


def test_cli_takes_the_preemption_settings_from_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["--set", "run.preempt_grace_s=200", "--set", "run.preempt_signal=SIGUSR2"]
    assert main(["--emit", "slurm", "--config", TINY, "--nnodes", "2", *sets]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --signal=B:USR2@270" in script and "trap '" in script and "' USR2" in script
    assert main(["--emit", "k8s", "--config", TINY, *K8S, "--nnodes", "2", "--set", "run.preempt_grace_s=200"]) == 0
    assert "terminationGracePeriodSeconds: 270" in capsys.readouterr().out


def test_emitted_files_are_ready_to_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sbatch parses (bash -n) and sizes its task; the JobSet parses and sizes its pods."""
    argv = ["--config", TINY, "--nnodes", "2", "--time", "2-00:00:00", "--cpus-per-node", "24"]
    assert main(["--emit", "slurm", *argv, "--mem-per-node", "256Gi"]) == 0
    script = capsys.readouterr().out
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    directives = {
        line.split("=")[0]: line.split("=", 1)[1]
        for line in script.splitlines()
        if "#SBATCH --" in line and "=" in line
    }
    assert directives["#SBATCH --time"] == "2-00:00:00" and directives["#SBATCH --cpus-per-task"] == "24"
    assert directives["#SBATCH --mem"] == "262144M" and directives["#SBATCH --signal"].startswith("B:USR1@")
    assert main(["--emit", "k8s", *argv, *K8S]) == 0
    pod = yaml.safe_load(capsys.readouterr().out)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    # 2 ranks per node: /dev/shm (64Gi) + 16Gi per rank, requested and limited alike; 24 CPUs asked.
    assert resources["requests"] == {"cpu": "24", "memory": "96Gi"} and resources["limits"]["memory"] == "96Gi"
    assert pod["containers"][0]["image"] == "i:1" and pod["terminationGracePeriodSeconds"] > 120
