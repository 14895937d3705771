"""What ``resilient-train`` exits with after a preemption, with torchrun stubbed out: 143 (requeued
by the emitted sbatch) only when the stop step is committed and nothing failed for a reason of its
own; an error torchrun restarted a group out of earlier in the launch does not count."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import resilient.tools.train as train
from resilient.runfiles import logs_dir, write_event
from resilient.trainer.observing.quiet import ERROR_EXIT, FINAL_MARK

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")

pytestmark = pytest.mark.timeout(30)


def _claim(run_dir: Path, line: str, *, final: bool = False) -> None:
    """A rank's claim of an error (as ``report_failure`` writes it)."""
    os.makedirs(logs_dir(str(run_dir)), exist_ok=True)
    with open(os.path.join(logs_dir(str(run_dir)), f"error-{time.monotonic_ns()}"), "w") as f:
        f.write(line + "\n" + (FINAL_MARK + "\n" if final else ""))
    time.sleep(0.05)  # the file's mtime (a coarse clock) before the next event's time, and after the last


def _stopped(run_dir: Path, groups: tuple[int, ...], *, committed: bool = True) -> None:
    for group in groups:
        write_event(str(run_dir), "preempted", group=group, step=7, signal="SIGTERM", seconds=1.0, committed=committed)
    time.sleep(0.05)


def _groups(run_dir: Path, monkeypatch: pytest.MonkeyPatch, job: Callable[[], int]) -> int:
    monkeypatch.setattr(train, "run_replicated", lambda launch, signals: job())
    sets = [f"run.dir={run_dir}", "parallel.dp_shard=1", "parallel.tp=1"]
    flags = ["--replica-groups", "2", "--nproc-per-group", "1", "--config", TINY]
    return train.run_replica_groups(train.parse_args([*flags, *(a for s in sets for a in ("--set", s))]))


def _one_group(run_dir: Path, monkeypatch: pytest.MonkeyPatch, job: Callable[[], int]) -> int:
    monkeypatch.setattr(train, "run", lambda command, grace_s, env, signals, watch: job())
    sets = [f"run.dir={run_dir}", "parallel.dp_shard=1", "parallel.tp=1"]
    return train.run_one_group(train.parse_args(["--config", TINY, *(a for s in sets for a in ("--set", s))]))


def test_an_error_a_group_recovered_from_before_the_stop_does_not_undo_the_preemption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def job() -> int:
        _claim(tmp_path, "error: [rank 0] quorum changed; restarting this group so that the quorum changes")
        _stopped(tmp_path, (0, 1))  # later, both groups saw the stop step committed
        return 143

    assert _groups(tmp_path, monkeypatch, job) == 143
    assert capsys.readouterr().err == ""


def test_an_error_after_the_stop_or_a_final_one_is_the_exit(tmp_path: Path, monkeypatch, capsys) -> None:
    def late() -> int:
        _claim(tmp_path / "late", "error: [rank 0] quorum changed; restarting this group")
        _stopped(tmp_path / "late", (0, 1))
        _claim(tmp_path / "late", "error: [rank 0] closing the writer failed")  # after the stop: why it ended
        return 143

    def final() -> int:
        _claim(tmp_path / "final", "error: checkpoint.url=/x is not shared", final=True)
        _stopped(tmp_path / "final", (0, 1))
        return 143

    assert _groups(tmp_path / "late", monkeypatch, late) == ERROR_EXIT
    assert capsys.readouterr().err.startswith("error: [rank 0] closing the writer failed (the groups' logs are in")
    assert _groups(tmp_path / "final", monkeypatch, final) == ERROR_EXIT
    assert capsys.readouterr().err.startswith("error: checkpoint.url=/x is not shared")


def test_groups_that_all_finished_after_recovering_from_an_error_exit_0(tmp_path: Path, monkeypatch, capsys) -> None:
    def job() -> int:
        _claim(tmp_path, "error: [rank 0] quorum changed; restarting this group")
        return 0

    assert _groups(tmp_path, monkeypatch, job) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("committed", "exits", "expected"),
    [
        (True, 143, 143),  # the ranks saved the stop step and exited 143
        (True, 128 + 10, 143),  # torchrun itself stopped by run.preempt_signal=SIGUSR1: still saved
        (False, 143, 1),  # not committed within the grace: the next start resumes from an older step
        (True, 1, 1),  # a rank failed after the stop (it said why): not resumable from it as is
        (True, 0, 0),  # torchrun restarted the ranks after the stop, and they finished the run
    ],
)
def test_one_group_exits_143_only_for_a_committed_stop_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, committed: bool, exits: int, expected: int
) -> None:
    def job() -> int:
        _stopped(tmp_path, (0,), committed=committed)
        return exits  # torchrun's exit code

    assert _one_group(tmp_path, monkeypatch, job) == expected
    err = capsys.readouterr().err
    assert ("did not see it committed" in err) == (not committed)
