"""What every resilient command line shares."""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable

from resilient.errors import disk_full


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2 (argparse would print the whole usage first)."""

    def error(self, message: str) -> None:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def one_line(err: BaseException) -> str:
    """An error's message on one line (its type's name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


def reader_of_stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end was closed (poll says POLLERR): a
    broken pipe elsewhere (a child's pipe, a socket) is an error like any other."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real fd (a captured stdout)
        return False


def stdout_closed() -> int:
    """The reader of stdout went away (``| head``): no error of ours, so no error line; the exit
    code a shell shows for a SIGPIPE death, and stdout pointed at /dev/null so that the
    interpreter's last flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def call_or_stdout_closed(command: Callable[[], int]) -> int:
    """``command()``, or 141 with no line when it failed because the reader of stdout went away;
    a broken pipe elsewhere is raised as the error it is."""
    try:
        return command()
    except BrokenPipeError:
        if not reader_of_stdout_gone():
            raise
        return stdout_closed()


def run_command(prog: str, command: Callable[[], int], *, debug: bool, expected: tuple[type, ...]) -> int:
    """``command()``'s exit code; an ``expected`` error (bad input, storage) is one line and 2 (1
    for a full disk), Ctrl-C 130, the reader of stdout gone 141 (``stdout_closed``), anything else one
    line naming its type and 2; tracebacks only with ``debug``."""
    try:
        return call_or_stdout_closed(command)
    except expected as e:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"{prog}: error: {one_line(e)}\n")
        return 1 if disk_full(e) else 2  # a full disk is the machine's failure, not bad input
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"{prog}: unexpected error: {type(e).__name__}: {one_line(e)} (rerun with --debug)\n")
        return 2
