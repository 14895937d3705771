"""Preemption: save the step in flight when the cluster asks the job to stop, then exit 143.

SLURM and Kubernetes stop a job with SIGTERM and a grace period (``KillWait``,
``terminationGracePeriodSeconds``); SLURM can also send a signal of the job's choosing ahead of its
time limit (``--signal=B:USR1@<s>``, ``run.preempt_signal``). Without this, the work since the last
periodic save would be lost. With it:

1. the signal handler only records the signal (a handler that raised could do so inside a
   collective or a half-written save);
2. before every step, the ranks agree whether any of them got one (a MAX all-reduce of one
   integer over the group): the signal reaches ranks at different moments, the stop step must be
   the same on all of them;
3. the ranks save that step (unless it is already committed) and wait until it is committed: a RAM
   snapshot alone would die with the pod, so this is a persistent save, agreed like every save.
   With replica groups only the group that writes the step saves it; the others do not wait for
   that group, so their step may not be committed yet when they stop (and is lost if that group
   fails: the next start then resumes from an older committed step);
4. each group's rank 0 records a ``preempted`` event (``step``, ``signal``, ``seconds``,
   ``committed``: seen committed when it stopped, ``wrote``: this group wrote it), and every rank
   exits 143 (128 + SIGTERM): the run is not finished, so neither a launcher nor a scheduler takes
   it for done, and the next start resumes from the newest committed step. A save that fails is an
   error like any other (exit 1 or 2, not 143); the replica-group launcher returns 143 only when no
   group reported an error.

The launcher gives torchrun a shutdown timeout (``torchrun --shutdown-timeout``) that covers
``run.preempt_grace_s``: torchrun kills its workers that long after passing the signal on.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from resilient.errors import CommitError
from resilient.runfiles import read_events

if TYPE_CHECKING:
    from resilient.trainer.config import TrainConfig

log = logging.getLogger(__name__)

PREEMPTED_EXIT = 128 + signal.SIGTERM
"""Exit status of a preempted run, whatever signal asked for it: not finished, resumable."""
PREEMPTED_EVENT = "preempted"
SHUTDOWN_MARGIN_S = 30.0
"""What torchrun and the launcher add to ``run.preempt_grace_s`` before killing: closing the
writer, the loader workers and the process group after the save."""


class Preempted(Exception):  # noqa: N818 - a stop, not an error: nothing may catch it as a ResilientError
    """The ranks stopped at ``step`` because the job was asked to (a signal): not a failure."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} at step {step}")
        self.step = step
        self.signum = signum


def preempt_signals(preempt_signal: str) -> list[signal.Signals]:
    """SIGTERM, and ``run.preempt_signal`` when it names another one."""
    signals = [signal.SIGTERM]
    if preempt_signal and getattr(signal, preempt_signal) != signal.SIGTERM:
        signals.append(getattr(signal, preempt_signal))
    return signals


class PreemptWatch:
    """Records the preemption signals this process receives (``install`` / ``uninstall``, or as a
    context manager); ``agreed`` tells every rank alike whether any rank got one."""

    def __init__(self, signals: list[signal.Signals]) -> None:
        self.signals = signals
        self.received = 0
        """The first preemption signal this rank got (0: none)."""
        self._previous: dict[signal.Signals, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._record) for sig in self.signals}

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> PreemptWatch:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def agreed(self, group: Any = None) -> int:
        """The signal some rank of ``group`` received (the largest number if several), 0 if none
        did; the same answer on every rank (collective). A one-rank world asks nobody."""
        import torch  # here: the launcher reads this module's constants without importing torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64)  # over gloo, also on a CUDA job
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def save_stop_step(
    step: int,
    *,
    wait: Callable[[], None],
    committed: Callable[[], list[int]],
    writes: Callable[[], bool],
    save: Callable[[], None],
) -> bool:
    """Save ``step`` unless it is committed or another group writes it (``writes``), and wait for its
    commit (collective). Whether this group wrote it."""
    try:  # a save still persisting first: if_busy="skip" must not skip this one
        wait()
    except CommitError as error:  # that earlier save failed (on every rank alike): this step still needs its own
        log.warning("preempted at step %d: an earlier save failed (%s); saving this step", step, error)
    # Committed, not "saved": a step restored from RAM was never written (the trainer counts it as
    # saved), and a save in flight may have been the one that just failed.
    wrote = step not in committed() and writes()
    if wrote:
        save()
    wait()
    return wrote


def stop_line(step: int, *, committed: bool, ours: bool) -> str:
    """What a group says when it stops: only the group that wrote the step (or a lone group) says it
    is committed without saying by whom."""
    if not committed:
        where = "is not committed here (a peer group writes it)"
    else:
        where = "is committed" if ours else "is committed (by a peer group)"
    return f"preempted: step {step} {where}; exiting {PREEMPTED_EXIT} to be resumed"


def stop_preempted(
    step: int,
    signum: int,
    *,
    save: Callable[[], None],
    committed: Callable[[], list[int]],
    record: Callable[..., None],
) -> Preempted:
    """Make ``step`` durable if this group writes it, and say what it saw: ``save`` saves (if this
    group writes the step) and waits for its commit (collective; it raises on every rank alike when
    the save fails), ``committed`` lists the committed steps
    (collective), ``record(event, **fields)`` writes the event (rank 0) and says whether the step
    is committed (``committed``). Returns the error to raise."""
    start = time.monotonic()
    durable = step == 0 or step in committed()
    if not durable:
        save()
        # Another replica group may be the one that writes this step (and may not have yet).
        durable = step in committed()
    record(
        PREEMPTED_EVENT,
        step=step,
        signal=signal.Signals(signum).name,
        seconds=round(time.monotonic() - start, 3),
        committed=durable,
    )
    return Preempted(step, signum)


# -- the launcher's side ---------------------------------------------------------------------


def preempt_flags(config: TrainConfig) -> list[str]:
    """torchrun's flags for a preemption (``resilient.trainer.preempt``): pass ``run.preempt_signal``
    on to the workers as it does SIGTERM, and give them ``run.preempt_grace_s`` plus a margin to save
    before it kills them (its default is 30 s)."""
    signals = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    if config.run.preempt_signal and config.run.preempt_signal not in signals:
        signals.append(config.run.preempt_signal)
    timeout = math.ceil(config.run.preempt_grace_s + SHUTDOWN_MARGIN_S)
    return ["--shutdown-timeout", str(timeout), "--signals-to-handle", ",".join(signals)]


def launcher_grace_s(config: TrainConfig, grace_s: float) -> float:
    """How long the launcher waits for a torchrun it signalled before killing it: never less than
    the time torchrun gives its workers to save (``preempt_flags``), and a margin for torchrun."""
    return max(grace_s, config.run.preempt_grace_s + SHUTDOWN_MARGIN_S) + 10.0


def forwarded_signals(config: TrainConfig | None) -> tuple[signal.Signals, ...]:
    """The signals a launcher passes on: Ctrl-C, SIGTERM and ``run.preempt_signal``."""
    extra = [getattr(signal, config.run.preempt_signal)] if config and config.run.preempt_signal else []
    return (signal.SIGINT, signal.SIGTERM, *extra)


def preempted_since(run_dir: str, since: float) -> dict | None:
    """The ``preempted`` event a group wrote at or after ``since`` (``time.time()``), if any."""
    return next((e for e in read_events(run_dir) if e.get("event") == PREEMPTED_EVENT and e["t"] >= since), None)
