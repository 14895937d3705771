"""How a failed run reaches the operator: one ``error:`` line and exit 2, not one traceback per rank.

A ``ResilientError`` on any rank (a corrupt chunk, a damaged manifest, a missing bucket, a changed
model shape) is reported once: the first rank to see it claims ``<run.dir>/logs/error-<run id>``
(create-if-absent, so exactly one rank wins) and prints the line; every rank then exits 2. A peer
that fails only because that rank left (a collective that lost its partner) sees the claimed file
and exits 2 quietly too. ``RESILIENT_DEBUG=1`` (``resilient-train --debug``) keeps the tracebacks.

``python -m resilient.trainer.observing.quiet`` is torchrun without its own ``ChildFailedError`` traceback:
it exits with the first failed rank's code, so the launcher can pass exit 2 on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from resilient.errors import ConfigError, ResilientError, disk_full
from resilient.runfiles import logs_dir

DEBUG_ENV = "RESILIENT_DEBUG"
ERROR_EXIT = 2
RUNTIME_EXIT = 1
"""A failure of the machine, not of the input (a full disk): rerunning once it is fixed resumes."""


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


LAUNCH_ENV = "RESILIENT_LAUNCH_ID"
"""Set by a multi-node launcher: there the run id is the operator's ``--rdzv-id``, which a rerun of
the same command repeats; this keeps that rerun's claim apart from the last one's."""


def error_path(run_dir: str) -> str:
    # torchrun gives every worker of one launch the same run id: a stale file of an earlier launch
    # never silences this one.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getppid()))
    if os.environ.get(LAUNCH_ENV):
        run_id += f"-{os.environ[LAUNCH_ENV]}"
    return os.path.join(logs_dir(run_dir), f"error-{run_id}")


FINAL_MARK = "final"
"""Second line of a claim whose error a restart cannot fix (a setting): the launcher stops torchrun
rather than let it restart the ranks into the same error (``final_claim_since``)."""


def claim_report(run_dir: str, message: str, *, final: bool = False) -> bool:
    """True if this rank is the first to report an error of this launch (and has recorded it)."""
    path = error_path(run_dir)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # the run directory is unwritable: better a line per rank than none
    with os.fdopen(fd, "w") as f:
        f.write(message + "\n" + (FINAL_MARK + "\n" if final else ""))
    return True


def final_claim_since(run_dir: str, since: float) -> str | None:
    """The line of a claim at or after ``since`` that no restart can fix (``claim_report(final=True)``)."""
    for path in _claims_since(run_dir, since):
        with contextlib.suppress(OSError), open(path) as f:
            lines = f.read().splitlines()
            if len(lines) > 1 and lines[1] == FINAL_MARK:
                return lines[0]
    return None


def _claims_since(run_dir: str, since: float) -> list[str]:
    folder = logs_dir(run_dir)
    claims = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            if name.startswith("error-") and os.stat(path).st_mtime >= since:
                claims.append((os.stat(path).st_mtime, path))
    return [path for _, path in sorted(claims)]


def reported_since(run_dir: str, since: float) -> str | None:
    """The error line a rank claimed (``claim_report``) at or after ``since`` (``time.time()``), the
    earliest if several groups claimed one; None if none did. For launchers whose ranks write to log
    files (replica groups), which print the line for them."""
    for path in _claims_since(run_dir, since):
        with contextlib.suppress(OSError), open(path) as f:
            line = f.readline().strip()
            if line:
                return line
    return None


def report_failure(run_dir: str, rank: int, error: BaseException) -> int | None:
    """The exit code for a worker that failed with ``error``; None: re-raise it (a traceback)."""
    if debug_enabled():
        return None
    if isinstance(error, ResilientError) or disk_full(error):
        # An agreed error already names the rank that saw it ("[rank 0 (and 1 other rank(s))] ...").
        line = f"error: {error}" if str(error).startswith("[rank ") else f"error: [rank {rank}] {error}"
        full = disk_full(error)
        # Final: a restart would meet the same setting, or the same full disk (nothing frees it).
        if claim_report(run_dir, line, final=isinstance(error, ConfigError) or full):
            print(line, file=sys.stderr, flush=True)
        # A full disk is a failure of the machine, not of the input: 1, not the usage code.
        return RUNTIME_EXIT if full else ERROR_EXIT
    if isinstance(error, KeyboardInterrupt):
        return 128 + 2  # Ctrl-C: torchrun passed the launcher's SIGINT on; the launcher says where we stood
    if isinstance(error, Exception) and os.path.exists(error_path(run_dir)):
        return ERROR_EXIT  # a peer reported the cause; this rank only lost its partner
    return None


def run_torchrun(argv: list[str]) -> int:
    # The agent's "failed (exitcode: 2)", "Received 15 death signal" and "closing signal" lines
    # repeat what the ranks and the launcher say; its loggers take their level from LOGLEVEL when
    # they are created, on import: so before the imports below.
    if not debug_enabled():
        os.environ.setdefault("LOGLEVEL", "CRITICAL")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not debug_enabled():  # these take the level of the "torch" logger instead (its closing-signal lines)
        logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(os.environ["LOGLEVEL"])
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        return 128 - code if code < 0 else (code or 1)
    except SignalException as e:
        return 128 + int(e.sigval)  # the workers were stopped with the same signal
    return 0


if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))
