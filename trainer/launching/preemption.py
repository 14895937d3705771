"""Preemption, the launcher's side (the ranks' side, and what a preemption does, is
``resilient.trainer.preempt``): the flags that make torchrun pass a preemption on and wait for the
save (``preempt_flags``), the mark that tells the ranks a SIGTERM is a preemption and not torchrun
stopping them after a failure (``PreemptMark``), how long a launcher waits and which signals it
forwards, and what it exits with once the ranks stopped (``preempted_events``, ``preempted_exit``)."""

from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile
from typing import TYPE_CHECKING

from resilient.errors import ResilientError
from resilient.runfiles import read_events
from resilient.trainer.observing.quiet import RUNTIME_EXIT
from resilient.trainer.preempt import PREEMPT_MARK_ENV, PREEMPTED_EVENT, PREEMPTED_EXIT, SHUTDOWN_MARGIN_S

if TYPE_CHECKING:
    from resilient.trainer.config import TrainConfig


class MarkError(ResilientError):
    """The launcher cannot create its preemption mark: the machine has no usable temporary folder
    (full, or unwritable), a failure of the machine rather than of the input."""


def preempt_flags(config: TrainConfig) -> list[str]:
    """torchrun's flags for a preemption (``resilient.trainer.preempt``): pass ``run.preempt_signal``
    on to the workers as it does SIGTERM, and give them ``run.preempt_grace_s`` plus a margin to save
    before it kills them (its default is 30 s)."""
    signals = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    if config.run.preempt_signal and config.run.preempt_signal not in signals:
        signals.append(config.run.preempt_signal)
    timeout = math.ceil(config.run.preempt_grace_s + SHUTDOWN_MARGIN_S)
    return ["--shutdown-timeout", str(timeout), "--signals-to-handle", ",".join(signals)]


class PreemptMark:
    """The launcher's side of ``PREEMPT_MARK_ENV``: ``env`` goes to torchrun (its ranks inherit it),
    ``set`` before the launcher sends a signal that asks the ranks to save and stop, ``close`` when
    the launch is over. The file lives in a private temporary folder: one per launcher, on its node."""

    def __init__(self) -> None:
        try:
            self._folder = tempfile.mkdtemp(prefix="resilient-preempt-")
        except OSError as e:  # before anything starts: say so in one line, not a traceback
            # (Not gettempdir() here: with no usable folder, it raises what mkdtemp just raised.)
            where = tempfile.tempdir or os.environ.get("TMPDIR") or "the temporary folder (/tmp)"
            raise MarkError(
                f"cannot create the preemption mark's folder in {where}: {e}; free space there or point "
                "TMPDIR at a writable local folder"
            ) from e
        self.path = os.path.join(self._folder, "preempting")

    def env(self) -> dict[str, str]:
        return {PREEMPT_MARK_ENV: self.path}

    def set(self) -> None:
        with open(self.path, "w"):
            pass

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


def launcher_grace_s(config: TrainConfig, grace_s: float) -> float:
    """How long the launcher waits for a torchrun it signalled before killing it: never less than
    the time torchrun gives its workers to save (``preempt_flags``), and a margin for torchrun."""
    return max(grace_s, config.run.preempt_grace_s + SHUTDOWN_MARGIN_S) + 10.0


def forwarded_signals(config: TrainConfig | None) -> tuple[signal.Signals, ...]:
    """The signals a launcher passes on: Ctrl-C, SIGTERM and ``run.preempt_signal``."""
    extra = [getattr(signal, config.run.preempt_signal)] if config and config.run.preempt_signal else []
    return (signal.SIGINT, signal.SIGTERM, *extra)


def preempted_events(run_dir: str, since: float, groups: list[int] | None = None) -> list[dict]:
    """The ``preempted`` events written at or after ``since``, of ``groups`` only when given."""
    return [
        e
        for e in read_events(run_dir)
        if e.get("event") == PREEMPTED_EVENT and e["t"] >= since and (groups is None or e.get("group") in groups)
    ]


def preempted_exit(events: list[dict]) -> tuple[int, str]:
    """What a replica-group launcher exits with after its groups stopped for a preemption
    (``events``: their ``preempted`` events, at least one): 143 when every group that stopped saw
    one and the same step committed; else 1 and the line that says why the run is not resumable
    from the stop step."""
    steps = sorted({int(e["step"]) for e in events})
    late = sorted(e.get("group", 0) for e in events if not e.get("committed"))
    if len(steps) == 1 and not late:
        return PREEMPTED_EXIT, ""
    if len(steps) > 1:
        return RUNTIME_EXIT, f"error: the replica groups stopped at different steps {steps} when preempted (a bug)"
    return RUNTIME_EXIT, (
        f"error: preempted at step {steps[0]} but group(s) {late} did not see it committed within "
        "run.preempt_grace_s: the next start resumes from the newest committed step"
    )
