"""What the operator of ``resilient-train`` sees when something goes wrong (issue 13, items 9, 10, 12):
one ``error:`` line and exit 2 for a config mistake (before any worker starts) or a ``ResilientError``
at run time, tracebacks only with ``--debug``; Ctrl-C says where the run stood and exits 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from tests.dist import run_world
from tests.procs import communicate_or_fail

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
TWO_RANKS = ["--set", "parallel.dp_shard=2", "--set", "parallel.tp=1"]
PACE = "tests.recovery.ram_hooks:pace"


def _launch(args: list[str], run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "resilient.tools.train", *args, "--set", f"run.dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RESILIENT_GROUP": "0", **(env or {})}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, str]:
    stdout, stderr = communicate_or_fail(proc, timeout_s, "resilient-train")
    return proc.returncode, stdout, stderr


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line.lower()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("recipe", "args", "says"),
    [
        ("[run]\nbogus = 1\n", [], "unknown key run.bogus"),
        ("[run\n", [], "is not valid TOML"),
        (None, ["--set", "run.steps=-1"], "run.steps=-1"),
        (None, ["--set", "parallel.tp=3"], "parallel.tp"),
        (None, ["--nproc", "3"], "--nproc 3"),
        (None, ["--set", "parallel.dp_shard=3"], "parallel.dp_shard=3"),
        ("missing", [], "does not exist"),
        ("directory", [], "cannot read config file"),
        ("latin1", [], "is not UTF-8 text"),
        (None, ["--set", "checkpoint.url=ftp://host/ckpt"], "checkpoint.url: unsupported checkpoint URL"),
        (None, ["--set", "checkpoint.url=s3://x/ckpt"], "checkpoint.url: S3 URL 's3://x/ckpt' has no valid bucket"),
    ],
)
def test_config_mistake_is_one_line_before_any_worker(
    tmp_path: Path, recipe: str | None, args: list, says: str
) -> None:
    path = TINY
    if recipe == "missing":
        path = str(tmp_path / "missing.toml")
    elif recipe == "directory":
        path = str(tmp_path)
    elif recipe == "latin1":
        path = str(tmp_path / "recipe.toml")
        Path(path).write_bytes("[run]\nsteps = 3 # größer\n".encode("latin-1"))
    elif recipe is not None:
        path = str(tmp_path / "recipe.toml")
        Path(path).write_text(recipe)
    run_dir = tmp_path / "run"
    start = time.monotonic()
    code, _, stderr = _finish(_launch(["--config", path, *args], run_dir), timeout_s=90)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], stderr
    assert "Traceback" not in stderr and "--nproc-per-node" not in stderr
    assert not run_dir.exists()  # no worker ever started: no pid file, no log, no checkpoint
    assert time.monotonic() - start < 60  # a hang guard only; the speed is held by the next test


@pytest.mark.timeout(60)
def test_unknown_flag_is_one_line(tmp_path: Path) -> None:
    code, _, stderr = _finish(_launch(["--frobnicate", "--config", TINY], tmp_path / "run"), timeout_s=50)
    assert code == 2 and stderr.splitlines() == [
        "resilient-train: error: unrecognized arguments: --frobnicate (see resilient-train --help)"
    ]


HEAVY_MODULES = ("torch", "tensorstore", "ml_dtypes", "zarr")


@pytest.mark.timeout(60)
def test_config_check_imports_no_heavy_module(tmp_path: Path) -> None:
    # The operator waits for this answer: importing torch, TensorStore and ml_dtypes costs ~4 s on
    # this machine, the check itself ~0.2 s. Held by what gets imported, not by a clock.
    probe = (
        "import sys\n"
        "from resilient.tools.train import main\n"
        f"code = main(['--config', {TINY!r}, '--set', 'run.bogus=1', '--set', 'run.dir={tmp_path}'])\n"
        f"print(code, sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert done.stderr.startswith("error: unknown key run.bogus"), done.stderr


def _train(run_dir: Path, steps: int, *extra: str) -> None:
    args = ["--config", TINY, *TWO_RANKS, "--set", f"run.steps={steps}", *extra]
    code, _, stderr = _finish(_launch(args, run_dir), timeout_s=180)
    assert code == 0, stderr[-4000:]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_runtime_error_is_one_line_and_exit_2_tracebacks_with_debug(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, 4)
    # A resume with a different model: every rank meets a RestoreError (a changed shape).
    resume = ["--config", TINY, *TWO_RANKS, "--set", "run.steps=8", "--set", "model.ffn_hidden_dim=96"]
    code, _, stderr = _finish(_launch(resume, run_dir), timeout_s=180)
    assert code == 2, stderr[-4000:]
    assert len(_error_lines(stderr)) == 1 and "Traceback" not in stderr, stderr[-4000:]
    code, _, stderr = _finish(_launch([*resume, "--debug"], run_dir), timeout_s=180)
    assert code != 0 and "Traceback" in stderr, stderr[-4000:]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_ctrl_c_says_where_the_run_stood_and_exits_130(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--config", TINY, *TWO_RANKS, "--set", "run.steps=200", "--set", "checkpoint.persist_every=2"]
    args += ["--set", f'run.step_hooks=["{PACE}"]']
    proc = _launch(args, run_dir, env={"RESILIENT_TEST_STEP_SLEEP": "0.3"})
    ckpt = Checkpointer(str(run_dir / "ckpt"))
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "ckpt").exists() and len(ckpt.steps()) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-4000:]
    proc.send_signal(signal.SIGINT)
    code, _, stderr = _finish(proc, timeout_s=120)
    assert code == 130 and "Traceback" not in stderr, stderr[-4000:]
    last = Checkpointer(str(run_dir / "ckpt")).steps()[-1]
    lines = [line for line in stderr.splitlines() if line.startswith("interrupted at step ")]
    assert lines and lines[0].endswith(f"last committed step {last}; rerun the same command to resume"), stderr
    assert _error_lines(stderr) == []
    # The last committed step loads: the same command (shorter) resumes from it and trains on.
    _train(run_dir, last + 2, "--set", "checkpoint.persist_every=2")
    assert Checkpointer(str(run_dir / "ckpt")).steps()[-1] == last + 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "outcome", ["rank_error", "crash", "interrupt", "preempted", "preempted_with_error", "preempted_not_committed"]
)
def test_replica_groups_launcher_says_what_its_groups_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], outcome: str
) -> None:
    # The groups' ranks write to log files; the launcher reads the one claimed error line back.
    from resilient.runfiles import write_event
    from resilient.tools import train as cli
    from resilient.trainer.observing.quiet import claim_report

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    claim_report(str(run_dir), "error: [rank 0] an old launch's error")  # stale: must not be shown
    old = time.time() - 3600
    for stale in (run_dir / "logs").iterdir():
        os.utime(stale, (old, old))

    def fake_run(launch, *signals) -> int:  # what the groups would have done
        if outcome.startswith("preempted"):  # both groups stopped after step 3; group 1 waits for group 0's commit
            write_event(launch.run_dir, "preempted", group=0, step=3, signal="SIGTERM", committed=True)
            late = outcome == "preempted_not_committed"
            write_event(launch.run_dir, "preempted", group=1, step=3, signal="SIGTERM", committed=not late)
        if outcome in ("rank_error", "preempted_with_error"):
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"group1-{launch.launch_id}")
            assert claim_report(launch.run_dir, "error: [rank 1] checkpoint step 4 is damaged: do X")
        return {"rank_error": 1, "crash": 1, "interrupt": 130}.get(outcome, 143)

    monkeypatch.setattr(cli, "run_replicated", fake_run)
    args = ["--replica-groups", "2", "--nproc-per-group", "1", "--config", TINY, "--set", f"run.dir={run_dir}"]
    args += ["--set", "parallel.dp_shard=1", "--set", "parallel.tp=1"]  # one rank per group, as launched
    code = cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == (0 if outcome == "preempted" else 1), err
    if outcome in ("rank_error", "preempted_with_error"):
        assert code == 2 and err[0].startswith("error: [rank 1] checkpoint step 4 is damaged: do X (the groups' logs")
    elif outcome == "crash":
        assert code == 1 and err[0].startswith("error: a replica group exited with 1;") and "logs" in err[0]
    elif outcome == "preempted":
        assert code == 143 and err == [], err
        return
    elif outcome == "preempted_not_committed":  # not resumable from the stop step: not 143
        assert code == 1 and err[0].startswith("error: preempted at step 3 but group(s) [1] did not see it"), err
        assert "run.preempt_grace_s" in err[0]
    else:
        assert code == 130 and err[0].startswith("interrupted at step"), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("line", "exit_code"), [("No space left on device", 1), ("checkpoint.url: bad", 2)])
def test_a_final_claim_stops_the_launcher_with_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, exit_code: int
) -> None:
    # A rank claimed an error no restart fixes (a setting, a full disk): 2 for bad input, 1 for the disk.
    from resilient.tools import train as cli
    from resilient.trainer.observing.quiet import claim_report

    run_dir = tmp_path / "run"

    def fake_run(command, grace_s, env, signals, watch) -> int:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fake-torchrun")
        assert claim_report(str(run_dir), f"error: [rank 0] {line}", final=True)
        assert watch(12345) is True  # the launcher stops torchrun at once
        return 1

    monkeypatch.setattr(cli, "run", fake_run)
    args = ["--config", TINY, "--set", f"run.dir={run_dir}", "--set", "parallel.dp_shard=1", "--set", "parallel.tp=1"]
    assert cli.main(["--nproc", "1", *args]) == exit_code


def _trainer_main(rank: int, world: int, run_dir: str) -> int:
    from resilient.trainer.train import main

    return main(["--config", TINY, *TWO_RANKS, "--set", f"run.dir={run_dir}"])


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_run_dir_no_rank_can_write_is_exit_2_on_every_rank_under_plain_torchrun(tmp_path: Path) -> None:
    """Only rank 0 writes the run-dir claim: before, it gave the one line and exit 2 while rank 1
    went on to write its pid file there and died with NotADirectoryError (a traceback, exit 1)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert run_world(_trainer_main, 2, str(blocker / "run")) == [2, 2]
