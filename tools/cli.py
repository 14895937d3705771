"""What every resilient command line shares."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Callable


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2 (argparse would print the whole usage first)."""

    def error(self, message: str) -> None:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def one_line(err: BaseException) -> str:
    """An error's message on one line (its type's name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


def stdout_closed() -> int:
    """The reader of stdout went away (``| head``): no error of ours, so no error line; the exit
    code a shell shows for a SIGPIPE death, and stdout pointed at /dev/null so that the
    interpreter's last flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def run_command(prog: str, command: Callable[[], int], *, debug: bool, expected: tuple[type, ...]) -> int:
    """``command()``'s exit code; an ``expected`` error (bad input, storage) is one line and 2,
    Ctrl-C 130, anything else one line naming its type and 2; tracebacks only with ``debug``."""
    try:
        return command()
    except BrokenPipeError:
        return stdout_closed()
    except expected as e:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"{prog}: error: {one_line(e)}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"{prog}: unexpected error: {type(e).__name__}: {one_line(e)} (rerun with --debug)\n")
        return 2
