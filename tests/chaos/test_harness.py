"""The harness's own failures: a failed start of the S3 endpoint leaks nothing, a crash still
writes report.json and exits 3 (not 1, "an invariant failed"), a failed twin is a failed
twin_match. No job is run."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from resilient.chaos import harness
from resilient.chaos import invariants as inv
from resilient.chaos.s3_proxy import MotoServer
from resilient.chaos.scenario import load_scenario, parse_scenario
from resilient.errors import ConfigError
from resilient.tools import chaos as cli

pytestmark = [pytest.mark.timeout(90)]


def test_a_failed_proxy_start_stops_moto_and_closes_its_log(tmp_path: Path, monkeypatch) -> None:
    started: list[MotoServer] = []

    class RecordedMoto(MotoServer):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    def broken_proxy(*args: object, **kwargs: object) -> None:
        raise OSError("no port for the proxy")

    monkeypatch.setattr(harness, "MotoServer", RecordedMoto)
    monkeypatch.setattr(harness, "FaultProxy", broken_proxy)
    scenario = parse_scenario({"job": {"config": "configs/tiny.toml", "storage": "s3"}})
    with pytest.raises(OSError, match="no port for the proxy"):
        harness._Storage(scenario, str(tmp_path))
    (moto,) = started
    assert moto.proc is not None and moto.proc.poll() is not None, "moto_server was left running"
    assert moto._log.closed


def test_moto_that_never_listens_leaks_neither_process_nor_log(tmp_path: Path, monkeypatch) -> None:
    procs: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: object, **kwargs: object) -> subprocess.Popen:
        procs.append(real_popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    monkeypatch.setattr(
        MotoServer,
        "_wait_listening",
        lambda self, timeout_s, log_path: (_ for _ in ()).throw(TimeoutError("did not listen")),
    )
    log = tmp_path / "moto.log"
    with pytest.raises(TimeoutError):
        MotoServer(str(log))
    (proc,) = procs
    assert proc.poll() is not None
    assert str(log) not in [f.path for f in psutil.Process().open_files()], "the log file was left open"


def _crash(exc: Exception):  # noqa: ANN202 (a stand-in for harness._run)
    def run(*args: object, **kwargs: object) -> dict:
        raise exc

    return run


def test_a_crash_of_the_harness_writes_the_report_and_exits_3(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(harness, "_run", _crash(KeyError("step")))
    report_dir = tmp_path / "report"
    assert cli.main(["run", "smoke", "--report", str(report_dir)]) == cli.EXIT_CRASH == 3
    report = json.loads((report_dir / "report.json").read_text())
    assert report["passed"] is False and report["scenario"]["name"] == "smoke"
    assert report["harness_error"]["type"] == "KeyError" and "KeyError: 'step'" in report["harness_error"]["traceback"]
    err = capsys.readouterr().err
    assert "HARNESS CRASHED" in err and "Traceback" not in err  # the traceback is in report.json
    assert cli.main(["run", "smoke", "--report", str(report_dir), "--debug"]) == cli.EXIT_CRASH
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("mistake", ["scenario-not-utf8", "report-under-a-file", "cache-under-a-file"])
def test_bad_input_is_one_line_and_exit_2_before_the_job_starts(tmp_path: Path, monkeypatch, capsys, mistake) -> None:
    monkeypatch.setattr(harness, "_run", _crash(AssertionError("the job must not start")))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    scenario, report, cache = "smoke", str(tmp_path / "report"), str(tmp_path / "cache")
    if mistake == "scenario-not-utf8":
        scenario = str(tmp_path / "latin1.toml")
        Path(scenario).write_bytes("description = 'größer'\n".encode("latin-1"))
    elif mistake == "report-under-a-file":
        report = str(blocker / "report")
    else:
        cache = str(blocker / "cache")
    code = cli.main(["run", scenario, "--report", report, "--cache", cache])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_CONFIG and len(lines) == 1, lines
    says = {"scenario-not-utf8": "not UTF-8 text", "report-under-a-file": f"--report {report} cannot be written"}
    assert lines[0].startswith("resilient-chaos: error: ")
    assert says.get(mistake, f"twin cache {cache} cannot be written (Not a directory); pass --cache DIR") in lines[0]


@pytest.mark.parametrize("where", ["report", "cache"])
def test_a_full_disk_is_one_line_that_says_so_not_bad_input(tmp_path: Path, monkeypatch, capsys, where: str) -> None:
    """ENOSPC making the --report or --cache folder: not "choose a writable directory" (exit 2)."""
    monkeypatch.setattr(harness, "_run", _crash(AssertionError("the job must not start")))
    real_makedirs = os.makedirs

    def makedirs(path: str, *args: object, **kwargs: object) -> None:
        if str(path).startswith(str(tmp_path / where)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    code = cli.main(["run", "smoke", "--report", str(tmp_path / "report"), "--cache", str(tmp_path / "cache")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_CRASH and line.startswith("resilient-chaos: error: the disk is full: "), line
    assert "No space left on device" in line and "--debug" not in line


def test_a_config_error_inside_the_run_writes_the_report_and_exits_2(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(harness, "_run", _crash(ConfigError("model.dim=-1 must be > 0")))
    report_dir = tmp_path / "report"
    assert cli.main(["run", "smoke", "--report", str(report_dir)]) == cli.EXIT_CONFIG
    assert json.loads((report_dir / "report.json").read_text())["harness_error"]["type"] == "ConfigError"


def test_exit_codes_are_in_the_help(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["run", "--help"])
    out = capsys.readouterr().out
    assert "1  an invariant failed" in out and "3  the harness itself crashed" in out


def test_a_failed_twin_is_a_failed_twin_match_not_a_crash(tmp_path: Path, monkeypatch) -> None:
    def failing_twin(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the fault-free twin failed (exit 1, timed out: False)")

    monkeypatch.setattr(harness, "get_twin", failing_twin)
    scenario = load_scenario("smoke")
    run = inv.RunData(
        run_dir=str(tmp_path / "run"),
        groups=2,
        steps=scenario.job.steps,
        checkpoint_url=str(tmp_path / "run" / "ckpt"),
        returncode=0,
    )
    for group in range(2):
        path = Path(run.group_file(group, "final.json"))
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"step": run.steps, "params_sha256": "p", "optim_sha256": "o"}))
    proc = SimpleNamespace(t_launch=0.0, t_end=1.0, returncode=0)
    storage = SimpleNamespace(url=run.checkpoint_url, proxy=None)
    report = harness._judge(scenario, run, [], proc, [], storage, str(tmp_path / "cache"), str(tmp_path), print)
    verdict = report["invariants"]["twin_match"]
    assert verdict["ok"] is False and "the fault-free twin could not be computed: RuntimeError" in verdict["reason"]
    assert report["passed"] is False and "error" in report["twin"]
