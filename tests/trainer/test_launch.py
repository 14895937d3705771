"""trainer/launching/launch.py: the command lines ``resilient-train`` runs and how it reports their exit
(no trainer is started here; the e2e tests launch real jobs)."""

from __future__ import annotations

import sys

import pytest

from resilient.errors import ConfigError
from resilient.tools.train import parse_args
from resilient.trainer.launching.launch import ReplicaLaunch, group_command
from resilient.trainer.launching.torchrun import run, torchrun_command


def test_launcher_arguments() -> None:
    args = parse_args(["--replica-groups", "2", "--nproc-per-group", "2"])
    assert (args.replica_groups, args.nproc_per_group, args.max_restarts) == (2, 2, None)  # 3 per group
    single = torchrun_command(parse_args(["--nproc", "2", "--max-restarts", "1"]))
    assert single[single.index("--max-restarts") + 1] == "1" and single[single.index("--nproc-per-node") + 1] == "2"
    assert "--max-restarts" not in torchrun_command(parse_args(["--nproc", "2"]))  # one group: no restarts
    with pytest.raises(SystemExit):
        parse_args(["--replica-groups", "2", "--nproc", "2"])
    assert parse_args(["--config", "r.toml"]).nproc is None  # from the recipe: parallel.dp_shard x tp
    with pytest.raises(SystemExit):
        parse_args(["--nproc", "0"])


def test_single_group_command_passes_config_and_overrides_on() -> None:
    sets = ["--set", "run.steps=3", "--set", "parallel.tp=1"]
    command = torchrun_command(parse_args(["--nproc", "4", "--config", "configs/tiny.toml", *sets]))
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--standalone" in command
    quiet = torchrun_command(parse_args(["--nproc", "4", "--config", "configs/tiny.toml", *sets]), quiet=True)
    assert quiet[:3] == [sys.executable, "-m", "resilient.trainer.observing.quiet"] and quiet[3:] == command[3:]
    assert command[command.index("-m", 3) :] == ["-m", "resilient.trainer", "--config", "configs/tiny.toml", *sets]


def test_group_command_is_one_torchrun_per_group_with_the_replica_keys() -> None:
    launch = ReplicaLaunch(groups=3, nproc_per_group=2, run_dir="runs/x", trainer_args=["--set", "run.steps=5"])
    first, second = group_command(launch, 1), group_command(launch, 2)
    assert first[first.index("--rdzv-id") + 1] == f"group1-{launch.launch_id}"
    assert second[second.index("--rdzv-id") + 1] == f"group2-{launch.launch_id}"
    # A later launch in the same run directory gets rendezvous (= run) ids of its own.
    again = ReplicaLaunch(groups=3, nproc_per_group=2, run_dir="runs/x", trainer_args=[], launch_id="other")
    assert group_command(again, 1)[first.index("--rdzv-id") + 1] == "group1-other"
    # Each group rendezvous on its own port: a restarted group must never meet another group's ranks.
    assert first[first.index("--rdzv-endpoint") + 1] != second[second.index("--rdzv-endpoint") + 1]
    assert first[first.index("--max-restarts") + 1] == "3" and first[first.index("--nproc-per-node") + 1] == "2"
    assert first[first.index("-m", 3) :] == [
        "-m",
        "resilient.trainer",
        "--set",
        "run.steps=5",
        "--set",
        "replica.enabled=true",
        "--set",
        "replica.groups=3",
    ]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"groups": 0}, "--replica-groups=0"),
        ({"nproc_per_group": 0}, "--nproc-per-group=0"),
        ({"max_restarts": -1}, "--max-restarts=-1"),
    ],
)
def test_replica_launch_rejects_bad_counts_naming_the_flag(kwargs: dict, flag: str) -> None:
    values = {"groups": 2, "nproc_per_group": 2, "run_dir": "runs/x", "trainer_args": [], **kwargs}
    with pytest.raises(ConfigError, match=flag):
        ReplicaLaunch(**values)


@pytest.mark.timeout(60)
def test_run_reports_the_exit_code_as_a_shell_does() -> None:
    assert run([sys.executable, "-c", "import sys; sys.exit(3)"], grace_s=5.0) == 3
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert run([sys.executable, "-c", killed], grace_s=5.0) == 128 + 9
