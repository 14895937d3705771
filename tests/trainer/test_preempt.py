"""Preemption (trainer/preempt.py): a SIGTERM, or ``run.preempt_signal``, makes the ranks agree on a
stop step, commit it, record a ``preempted`` event and exit 143; the next start resumes from it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from resilient import Checkpointer
from resilient.runfiles import read_events, read_jsonl_by_step
from resilient.tools import train as train_cli
from resilient.trainer import preempt
from resilient.trainer.config import load_config
from resilient.trainer.launching.preemption import PreemptMark, forwarded_signals, launcher_grace_s, preempt_flags
from resilient.trainer.preempt import PREEMPT_MARK_ENV, PREEMPTED_EXIT, PreemptWatch, preempt_signals
from tests.procs import communicate_or_fail

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
PACE = "tests.recovery.ram_hooks:pace"


@pytest.mark.timeout(10)
def test_the_watch_records_the_first_signal_and_restores_the_handlers() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptWatch(preempt_signals("SIGUSR1")) as watch:
        assert watch.flags() == [0.0, 0.0] and watch.agreed_signal(watch.start_flags().wait()) == 0
        assert watch.deadline(5.0) - time.monotonic() == pytest.approx(5.0, abs=0.5)  # no signal: from now
        sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        handled = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.received == signal.SIGUSR1 and watch.flags() == [0.0, 1.0]  # [SIGTERM, SIGUSR1]
        # The grace runs from the first signal on, however long the stop step takes after it.
        assert sent <= watch.received_at <= handled
        time.sleep(0.2)
        assert watch.deadline(5.0) == watch.received_at + 5.0
        assert watch.agreed_signal(watch.start_flags().wait()) == signal.SIGUSR1  # no process group: alone
    # Summed over ranks: one rank's SIGTERM and another's SIGUSR1 give the larger number on every rank.
    assert watch.agreed_signal([1.0, 1.0]) == signal.SIGTERM and watch.agreed_signal([0.0, 2.0]) == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before
    assert preempt_signals("") == [signal.SIGTERM]


@pytest.mark.timeout(10)
def test_under_a_marking_launcher_only_a_marked_sigterm_or_a_dead_parent_asks_to_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mark = PreemptMark()
    try:
        monkeypatch.setenv(PREEMPT_MARK_ENV, mark.path)
        monkeypatch.setattr(preempt, "MARK_WAIT_S", 1.0)
        watch = PreemptWatch(preempt_signals("SIGUSR1"))
        with watch:
            assert watch._watcher is not None and watch._watcher.is_alive()  # woken through set_wakeup_fd
            # torchrun's own SIGTERM (a rank failed): end once no mark came in MARK_WAIT_S; the preempt
            # signal is never torchrun's.
            start = time.monotonic()
            assert not watch.asks_to_save(signal.SIGTERM) and watch.asks_to_save(signal.SIGUSR1)
            assert preempt.MARK_WAIT_S <= time.monotonic() - start < preempt.MARK_WAIT_S + 1.0
            # A scheduler signalling the whole job at once: the rank's SIGTERM comes before the
            # launcher's mark, which follows within the wait.
            threading.Timer(0.3, mark.set).start()
            assert watch.asks_to_save(signal.SIGTERM)
            os.unlink(mark.path)
            parent, launcher = preempt._lineage()
            monkeypatch.setattr(preempt, "_lineage", lambda: (parent, 1))  # the launcher died: its death signal
            assert watch.asks_to_save(signal.SIGTERM)
            monkeypatch.setattr(preempt, "_lineage", lambda: (parent, launcher))
            mark.set()  # the launcher passes a preemption on
            assert watch.asks_to_save(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # marked: recorded, the process lives on
            assert watch.received == signal.SIGTERM
        assert watch._watcher is None and signal.set_wakeup_fd(-1) == -1  # uninstalled: no fd left behind
        monkeypatch.delenv(PREEMPT_MARK_ENV)
        assert PreemptWatch([signal.SIGTERM]).asks_to_save(signal.SIGTERM)  # plain torchrun: every SIGTERM
    finally:
        mark.close()
    assert not os.path.exists(os.path.dirname(mark.path))


@pytest.mark.timeout(20)
def test_uninstall_is_prompt_while_a_forked_child_holds_the_wakeup_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank's loader workers are forked after the watch is installed: their copies of the pipe's
    # write end must not keep the watcher (and the rank's exit) waiting.
    monkeypatch.setenv(PREEMPT_MARK_ENV, "/nonexistent/mark")
    watch = PreemptWatch([signal.SIGTERM])
    watch.install()
    child = os.fork()
    if child == 0:
        time.sleep(5.0)
        os._exit(0)
    try:
        start = time.monotonic()
        watch.uninstall()
        assert time.monotonic() - start < 1.0 and watch._watcher is None
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@pytest.mark.timeout(20)
def test_an_unmarked_sigterm_after_a_rank_of_the_node_exited_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun stops the survivors once a rank exited: no wait for a mark that will not come. Until
    # one has, an unmarked SIGTERM waits the whole MARK_WAIT_S (the launcher may be slow to mark).
    monkeypatch.setenv(PREEMPT_MARK_ENV, "/nonexistent/mark")
    monkeypatch.setattr(preempt, "MARK_WAIT_S", 1.5)
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    watch = PreemptWatch([signal.SIGTERM])
    watch._lineage, watch._siblings = preempt._lineage(), [sibling.pid]
    try:
        start = time.monotonic()
        assert not watch.asks_to_save(signal.SIGTERM)
        assert time.monotonic() - start >= 1.5  # alive: the full wait
        sibling.kill()
        sibling.wait(timeout=10)
        start = time.monotonic()
        assert not watch.asks_to_save(signal.SIGTERM)
        assert time.monotonic() - start < 0.5  # gone: at once
    finally:
        sibling.kill()
        sibling.wait(timeout=10)


_CHILD_SIGTERM = """
import os, signal, sys, time
from resilient.trainer import preempt
preempt.MARK_WAIT_S = 0.3
watch = preempt.PreemptWatch([signal.SIGTERM])
watch.install()
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    os.write(ready_w, b"1")  # past fork: the at-fork hooks ran
    time.sleep(5.0)
    os._exit(0)
os.read(ready_r, 1)
os.kill(child, signal.SIGTERM)
os.waitpid(child, 0)
time.sleep(1.5)  # the parent's watcher would have ended it by now
watch.uninstall()
print("alive")
"""


@pytest.mark.timeout(30)
def test_a_sigterm_to_a_forked_child_does_not_end_the_rank() -> None:
    # A loader worker forked after install inherits the wakeup fd: its SIGTERM must not reach the
    # rank's watcher as the rank's own.
    env = {**os.environ, PREEMPT_MARK_ENV: "/nonexistent/mark"}
    done = subprocess.run([sys.executable, "-c", _CHILD_SIGTERM], env=env, capture_output=True, text=True, timeout=20)
    assert (done.returncode, done.stdout.strip()) == (0, "alive"), done.stderr[-2000:]


@pytest.mark.timeout(10)
def test_torchrun_waits_out_the_grace_and_passes_the_preempt_signal_on() -> None:
    config = load_config(TINY, ["run.preempt_signal='SIGUSR1'", "run.preempt_grace_s=200"])
    flags = preempt_flags(config)
    assert flags[flags.index("--shutdown-timeout") + 1] == "230"  # grace + margin, not torchrun's 30 s
    assert flags[flags.index("--signals-to-handle") + 1].split(",")[-1] == "SIGUSR1"
    assert launcher_grace_s(config, 30.0) >= 230
    assert forwarded_signals(config) == (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("groups", [[], ["--replica-groups", "2", "--nproc-per-group", "4"]])
@pytest.mark.parametrize("why", ["no folder", "full", "no usable folder at all"])
def test_a_launcher_that_cannot_create_its_preemption_mark_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], groups: list[str], why: str
) -> None:
    """The mark's folder cannot be made (the temporary folder is gone, or full): one line and exit 1
    (the machine's failure), before torchrun or a replica group starts (before: an OSError traceback)."""
    missing = tmp_path / "no-such-tmp"
    monkeypatch.setattr(tempfile, "tempdir", str(missing))
    where = str(missing)
    if why == "no usable folder at all":  # gettempdir() itself raises: the handler must not call it
        monkeypatch.setattr(tempfile, "tempdir", None)
        monkeypatch.delenv("TMPDIR", raising=False)
        monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(missing)])
        where = "the temporary folder (/tmp)"
    if why == "full":

        def full(*args: object, **kwargs: object) -> str:
            raise OSError(errno.ENOSPC, "No space left on device", str(missing))

        monkeypatch.setattr(tempfile, "mkdtemp", full)
    run_dir = tmp_path / "run"
    code = train_cli.main(["--config", TINY, "--set", f"run.dir={run_dir}", *groups])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err == [err[0]] and err[0].startswith(f"error: cannot create the preemption mark's folder in {where}: ")
    assert "TMPDIR" in err[0] and ("No space left" in err[0]) == (why == "full")
    assert not (run_dir / "logs").exists() or not any((run_dir / "logs").iterdir())  # no group started


def _launch(run_dir: Path, steps: int, *sets: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "resilient.tools.train", "--config", TINY]
    items = ["parallel.dp_shard=2", "parallel.tp=1", f"run.dir={run_dir}", f"run.steps={steps}", *sets]
    command += [arg for item in items for arg in ("--set", item)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RESILIENT_TEST_STEP_SLEEP": "0.2"}
    env.pop("RESILIENT_GROUP", None)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int) -> None:
    metrics = str(run_dir / "group0" / "metrics.jsonl")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and len(read_jsonl_by_step(metrics)) < steps:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-4000:]


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_preempted_run_commits_its_step_exits_143_and_resumes_there(tmp_path: Path, sig: str) -> None:
    run_dir = tmp_path / "run"
    # No periodic save: whatever is committed, the preemption saved.
    sets = ["checkpoint.persist_every=1000", f'run.step_hooks=["{PACE}"]', "run.preempt_signal='SIGUSR1'"]
    proc = _launch(run_dir, 500, *sets)
    _wait_for_steps(proc, run_dir, 3)
    proc.send_signal(getattr(signal, sig))
    stdout, stderr = communicate_or_fail(proc, 120, "resilient-train")
    assert proc.returncode == PREEMPTED_EXIT, stderr[-4000:]
    (event,) = [e for e in read_events(str(run_dir)) if e["event"] == "preempted"]
    stop = event["step"]
    assert stop >= 3 and event["signal"] == sig and event["group"] == 0 and event["committed"] is True
    assert Checkpointer(str(run_dir / "ckpt")).steps() == [stop]  # durable: committed to storage
    assert f"preempted: step {stop} is committed" in stdout and "Traceback" not in stderr, stderr[-4000:]
    # torchrun's agent says nothing of its own: no "Received 15 death signal" / "closing signal" lines.
    assert "death signal" not in stderr and "closing signal" not in stderr, stderr[-4000:]
    if sig == "SIGUSR1":
        return
    # The next start resumes from the saved step: its first logged step is the one after it.
    resumed = _launch(run_dir, stop + 2, *sets)
    _, stderr = communicate_or_fail(resumed, 180, "resilient-train")
    assert resumed.returncode == 0, stderr[-4000:]
    restores = [e for e in read_events(str(run_dir)) if e["event"] == "restore" and e["t"] > event["t"]]
    assert restores and all(e["step"] == stop for e in restores), restores
    assert Checkpointer(str(run_dir / "ckpt")).steps() == [stop, stop + 2]
    # The preemption is why the second start happened (its startup event's cause).
    starts = [e["cause"] for e in read_events(str(run_dir)) if e["event"] == "startup"]
    assert starts == ["first", "preempted"], starts


def _job_processes(run_dir: Path) -> list[int]:
    """Processes whose command line names ``run_dir`` (torchrun and its workers), but not this one."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if str(run_dir).encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_sigkilled_launcher_leaves_no_process_of_its_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, 500, "checkpoint.persist_every=1000", f'run.step_hooks=["{PACE}"]')
    _wait_for_steps(proc, run_dir, 2)
    assert len(_job_processes(run_dir)) >= 3  # the launcher, torchrun, two ranks
    proc.kill()  # SIGKILL: the launcher runs no cleanup of its own
    deadline = time.monotonic() + 200  # torchrun stops its workers, which save first (preempt grace)
    while time.monotonic() < deadline and _job_processes(run_dir):
        time.sleep(0.5)
    left = _job_processes(run_dir)
    for pid in left:  # do not leak them into the next test
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=30)  # its pipes close with the last process that inherited them
    assert left == []
    # They did not just vanish: torchrun passed the launcher's death on and the ranks saved.
    assert [e["event"] for e in read_events(str(run_dir)) if e["event"] == "preempted"] == ["preempted"]
