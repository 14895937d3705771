"""What every command line shares (tools/cli.py): exit codes of ``run_command``."""

from __future__ import annotations

import errno
import io
import os
import sys

import pytest

from resilient.errors import ConfigError
from resilient.tools.cli import run_command

pytestmark = pytest.mark.timeout(30)


def _raising(error: BaseException):
    def command() -> int:
        raise error

    return command


def _broken_pipe() -> BrokenPipeError:
    return BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_a_reader_of_stdout_that_went_away_is_141_and_no_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` exited
    with os.fdopen(write_end, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        code = run_command("prog", _raising(_broken_pipe()), debug=False, expected=(OSError,))
        monkeypatch.undo()
    assert code == 141 and capsys.readouterr().err == ""


def test_a_broken_pipe_elsewhere_is_an_error_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """stdout is fine (here: a buffer, no fd); the pipe that broke is another one (a child's)."""
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    code = run_command("prog", _raising(_broken_pipe()), debug=False, expected=(OSError,))
    assert code == 2 and capsys.readouterr().err == "prog: error: [Errno 32] Broken pipe\n"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("bad value"), 2),
        (OSError(errno.ENOSPC, "No space left on device"), 1),  # the machine's failure, not bad input
        (KeyboardInterrupt(), 130),
        (ValueError("boom"), 2),
    ],
)
def test_exit_codes(error: BaseException, code: int, capsys) -> None:
    assert run_command("prog", _raising(error), debug=False, expected=(ConfigError, OSError)) == code
    err = capsys.readouterr().err
    assert err.count("\n") == (0 if code == 130 else 1) and "Traceback" not in err
