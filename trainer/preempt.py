"""Preemption: save the step in flight when the cluster asks the job to stop, then exit 143.

SLURM and Kubernetes stop a job with SIGTERM and a grace period (``KillWait``,
``terminationGracePeriodSeconds``); SLURM can also send a signal of the job's choosing ahead of its
time limit (``--signal=B:USR1@<s>``, ``run.preempt_signal``). Without this, the work since the last
periodic save would be lost. With it:

1. the signal handler only records the signal (a handler that raised could do so inside a
   collective or a half-written save);
2. every step carries each rank's signal flags (one count per preemption signal) in the sums it
   already reduces over the data-parallel ranks, the pipeline stages and, with replica groups, over
   every participating group (``StopFlags``): no collective of its own. A committed step's sums are
   the same on every rank of every participating group, so all of them stop after that same step
   (the one in flight when the signal came), though the signal reaches nodes and groups at
   different moments. Tensor-parallel peers share their sums without reducing them, so their flags
   are first combined over the tp group, started when the step starts and waited for when the sums
   are built (it overlaps the step's compute);
3. the group that writes the step (a lone group; with replica groups the one the trainer's rule
   names) saves it unless it is already committed, and waits until it is committed: a RAM snapshot
   alone would die with the pod, so this is a persistent save, agreed like every save. The other
   groups wait until they see that step committed, up to ``run.preempt_grace_s`` after the signal
   (``PreemptWatch.deadline``: torchrun's kill counts from there too);
4. each group's rank 0 records a ``preempted`` event (``step``, ``signal``, ``seconds``,
   ``committed``: seen committed when it stopped, ``wrote``: this group wrote it), and every rank
   exits 143 (128 + SIGTERM) when the step is committed: the run is not finished, so neither a
   launcher nor a scheduler takes it for done, and the next start resumes from that step. A step
   not committed within the grace exits 1 (the next start resumes from an older step); a save that
   fails is an error like any other (exit 1 or 2, not 143). The launcher returns 143 only when
   every group that stopped saw the same step committed and no rank failed after the stop (an
   error torchrun restarted a group out of before it does not count).

The launcher gives torchrun a shutdown timeout (``torchrun --shutdown-timeout``) that covers
``run.preempt_grace_s``: torchrun kills its workers that long after passing the signal on.

torchrun also sends SIGTERM on its own: when a rank fails it stops the others (to restart the
group, or to give up) and kills them 30 s later (a constant in torchrun). Saving then is pointless
(the failed rank's part of the step is gone) and waiting costs the whole group's recovery those
30 s, since a survivor blocked in a collective with the dead rank never reaches its stop step. So
under our launcher a SIGTERM is a preemption only when the launcher says so: it creates the file
that ``RESILIENT_PREEMPT_MARK`` names (``PreemptMark``, in ``resilient.trainer.launching.preemption``
with the rest of the launcher's side) before it passes a signal on, and a rank whose torchrun or
launcher died (their death signal, no one left to mark) saves as well. Any other
SIGTERM ends the rank at once with exit 1 (``PreemptWatch``: a thread woken through
``signal.set_wakeup_fd`` decides, since a Python handler cannot run while the main thread is inside
a collective); what is committed stays the resume point. Without the variable (plain torchrun under
a scheduler) every SIGTERM is a preemption, as the scheduler's cannot be told from torchrun's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from resilient.errors import CommitError
from resilient.runfiles import group_id, write_event
from resilient.trainer.observing.quiet import RUNTIME_EXIT

if TYPE_CHECKING:
    from resilient.trainer.loop import Trainer

log = logging.getLogger(__name__)

PREEMPTED_EXIT = 128 + signal.SIGTERM
"""Exit status of a preempted run, whatever signal asked for it: not finished, resumable."""
PREEMPTED_EVENT = "preempted"
SHUTDOWN_MARGIN_S = 30.0
"""What torchrun and the launcher add to ``run.preempt_grace_s`` before killing: closing the
writer, the loader workers and the process group after the save."""
PREEMPT_MARK_ENV = "RESILIENT_PREEMPT_MARK"
"""Set by the launcher: the file that exists once it passed a preemption on (``PreemptMark``)."""
MARK_WAIT_S = 5.0
"""How long an unmarked SIGTERM waits for the mark before it ends the rank, unless a rank of this
node already exited (then torchrun is stopping the group after a failure: at once). A scheduler
that signals every process of the job at once (SLURM's preemption grace, ``scancel``, a node
shutdown) reaches the launcher in the same instant, and the launcher marks before it passes
anything on; the wait covers a launcher whose main thread is slow to run its handler."""
WATCHER_JOIN_S = 5.0
"""How long ``uninstall`` waits for the watcher thread to see its stop byte."""


class Preempted(Exception):  # noqa: N818 - a stop, not an error: nothing may catch it as a ResilientError
    """The ranks stopped at ``step`` because the job was asked to (a signal): not a failure.
    ``committed``: the step was seen committed (exit 143), else exit 1."""

    def __init__(self, step: int, signum: int, committed: bool = True) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} at step {step}")
        self.step = step
        self.signum = signum
        self.committed = committed


def preempt_signals(preempt_signal: str) -> list[signal.Signals]:
    """SIGTERM, and ``run.preempt_signal`` when it names another one."""
    signals = [signal.SIGTERM]
    if preempt_signal and getattr(signal, preempt_signal) != signal.SIGTERM:
        signals.append(getattr(signal, preempt_signal))
    return signals


class PreemptWatch:
    """Records the preemption signals this process receives (``install`` / ``uninstall``, or as a
    context manager); ``flags`` and ``agreed_signal`` turn them into what a step's sums carry.
    Under a launcher that marks its preemptions (``PREEMPT_MARK_ENV``) an unmarked SIGTERM ends the
    process at once instead (exit ``RUNTIME_EXIT``), even while the main thread waits in a collective."""

    def __init__(self, signals: list[signal.Signals]) -> None:
        self.signals = signals
        self.received = 0
        """The first preemption signal this rank got (0: none)."""
        self.received_at = 0.0
        """When (``time.monotonic``) it came: the grace runs from then, not from the stop step."""
        self._previous: dict[signal.Signals, Any] = {}
        self._mark = os.environ.get(PREEMPT_MARK_ENV, "")
        self._lineage = (0, 0)
        self._siblings: list[int] = []  # the other ranks torchrun runs on this node, at install
        self._wakeup: tuple[int, int, int] | None = None  # (read end, write end, the previous wakeup fd)
        self._watcher: threading.Thread | None = None
        self._stopping = False

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if not self.asks_to_save(signum):
            self._end_now(signum)  # the watcher thread may not have run yet (or its fd was replaced)
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()

    def asks_to_save(self, signum: int) -> bool:
        """Whether ``signum`` asks this rank to save and stop (a preemption) rather than to end now:
        every watched signal but an unmarked SIGTERM under a marking launcher whose torchrun and
        launcher are both still there (then it is torchrun stopping the group after a rank failed),
        ``MARK_WAIT_S`` after the signal came."""
        if signum != signal.SIGTERM or not self._mark:
            return True
        deadline = time.monotonic() + MARK_WAIT_S
        while True:
            # The launcher marked it, or torchrun or the launcher died (their death signal).
            if os.path.exists(self._mark) or _lineage() != self._lineage:
                return True
            # A rank of this node exited: torchrun stops the others to restart or give up.
            if time.monotonic() >= deadline or any(not _alive(pid) for pid in self._siblings):
                return False
            time.sleep(0.02)

    def _end_now(self, signum: int) -> None:
        # Written straight to the fd: this may run in a signal handler that interrupted a write to
        # the same stream (a reentrant flush raises), or with a stream's pipe full.
        gone = [pid for pid in self._siblings if not _alive(pid)]
        why = f"rank pid(s) {gone} of this node exited" if gone else f"no mark within {MARK_WAIT_S:.0f} s"
        line = (
            f"{signal.Signals(signum).name} is not a preemption ({why}): torchrun stops this rank; exiting "
            f"{RUNTIME_EXIT} (the newest committed step stays the resume point)\n"
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(RUNTIME_EXIT)  # now: the main thread may be inside a collective that never returns

    def _watch(self, read_fd: int) -> None:
        """The signal numbers the C handler writes to the wakeup fd, read while the main thread may
        be blocked in C++ (where Python handlers wait); ends when ``uninstall`` wakes it to stop."""
        while data := _read(read_fd):
            if signal.SIGTERM in data and not self.asks_to_save(signal.SIGTERM):
                self._end_now(signal.SIGTERM)
            if self._stopping:
                return

    def _start_watcher(self) -> None:
        self._stopping = False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._wakeup = (read_fd, write_fd, previous)
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), name="preempt-watch", daemon=True)
        self._watcher.start()
        _WATCHES.add(self)
        _forget_watches_in_children()

    def _stop_watcher(self) -> None:
        if self._wakeup is None:
            return
        read_fd, write_fd, previous = self._wakeup
        signal.set_wakeup_fd(previous)
        # A byte, not end-of-file: the loader workers forked meanwhile hold copies of the write end.
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")
        _WATCHES.discard(self)
        if self._watcher is not None:
            self._watcher.join(timeout=WATCHER_JOIN_S)
            if self._watcher.is_alive():  # its fds may not be closed under it: a socket may reuse them
                log.warning("the preemption watcher did not stop in %.0f s; leaving its pipe open", WATCHER_JOIN_S)
                self._wakeup = self._watcher = None
                return
        os.close(write_fd)
        os.close(read_fd)
        self._wakeup = self._watcher = None

    def forget_in_child(self) -> None:
        """In a process forked from this one: the wakeup fd and the pipe are the parent's (a SIGTERM
        to the child would otherwise wake the parent's watcher as its own)."""
        if self._wakeup is None:
            return
        read_fd, write_fd, _ = self._wakeup
        signal.set_wakeup_fd(-1)
        for fd in (read_fd, write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wakeup = self._watcher = None

    def deadline(self, grace_s: float) -> float:
        """When (``time.monotonic``) the stop must be over: ``grace_s`` after the signal, which the
        scheduler and torchrun count from (their kill comes a margin later, ``SHUTDOWN_MARGIN_S``);
        from now on a rank that only learnt of the stop from a peer's flags."""
        return (self.received_at if self.received else time.monotonic()) + grace_s

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._record) for sig in self.signals}
        if self._mark:
            self._lineage = _lineage()
            self._siblings = _siblings()
            self._start_watcher()

    def uninstall(self) -> None:
        self._stop_watcher()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> PreemptWatch:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def flags(self) -> list[float]:
        """This rank's flags, one per watched signal (1.0: received): summed over ranks and groups,
        a flag stays non-zero and a signal cannot be mistaken for another."""
        return [1.0 if self.received == sig else 0.0 for sig in self.signals]

    def agreed_signal(self, counts: list[float]) -> int:
        """The signal the summed ``counts`` say some rank received (the largest number if several,
        the same on every rank that summed the same counts); 0 if none."""
        return max((int(sig) for sig, n in zip(self.signals, counts, strict=True) if n > 0), default=0)

    def start_flags(self, group: Any = None) -> StopFlags:
        """This rank's flags as they stand, combined (MAX) over ``group`` in the background: the
        ranks of ``group`` must all put the same flags in sums they do not reduce among themselves."""
        return StopFlags(self.flags(), group)


_WATCHES: set[PreemptWatch] = set()
_AT_FORK_REGISTERED = False


def _forget_watches_in_children() -> None:
    """Once per process: a forked child (a loader worker, a user's pool) drops the watches' wakeup
    fd and pipes (``PreemptWatch.forget_in_child``); an at-fork hook cannot be unregistered."""
    global _AT_FORK_REGISTERED
    if not _AT_FORK_REGISTERED:
        os.register_at_fork(after_in_child=lambda: [watch.forget_in_child() for watch in list(_WATCHES)])
        _AT_FORK_REGISTERED = True


def _siblings() -> list[int]:
    """The other processes torchrun (this process's parent) runs: the ranks of this node."""
    parent, me = os.getppid(), os.getpid()
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{parent}/task"):  # each thread's children: any may have started a rank
            with open(f"/proc/{parent}/task/{task}/children") as f:
                children += [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return []  # no children lists (a kernel without them): the mark's wait decides alone
    return [pid for pid in children if pid != me]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (not gone, not a zombie waiting for torchrun to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 64)
    except OSError:
        return b""


def _lineage() -> tuple[int, int]:
    """This process's parent (torchrun) and that one's parent (the launcher): a death signal comes
    after the dead process's children were handed to another parent, so a changed pair says who died."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as f:
            return parent, int(f.read().rsplit(")", 1)[1].split()[1])  # after the name: state, ppid
    except (OSError, ValueError, IndexError):
        return parent, 0


class StopFlags:
    """One step's preemption flags: started when the step starts, read (``wait``) when the step
    builds its sums. Over a group of more than one rank an ``async_op`` all-reduce (MAX) runs
    meanwhile, so the step's compute hides it."""

    def __init__(self, flags: list[float], group: Any = None) -> None:
        import torch  # here: the launcher reads this module's constants without importing torch
        import torch.distributed as dist

        self._work = None
        self._tensor = torch.tensor(flags, dtype=torch.float64)  # over gloo, also on a CUDA job
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            self._work = dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def wait(self) -> list[float]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor.tolist()


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


def stop_line(step: int, *, committed: bool, ours: bool, grace_s: float = 0.0) -> str:
    """What a group says when it stops: only the group that wrote the step (or a lone group) says it
    is committed without saying by whom."""
    if not committed:
        return (
            f"preempted: step {step} is not committed (the group that writes it did not commit it within "
            f"run.preempt_grace_s={grace_s:g}); exiting 1: the next start resumes from an older step"
        )
    where = "is committed" if ours else "is committed (by a peer group)"
    return f"preempted: step {step} {where}; exiting {PREEMPTED_EXIT} to be resumed"


def stop_preempted(
    step: int,
    signum: int,
    *,
    save: Callable[[], None],
    committed: Callable[[], list[int]],
    settled: Callable[[], list[int]],
    record: Callable[..., None],
) -> Preempted:
    """Make ``step`` durable and say what happened: ``save`` saves (if this group writes the step)
    and waits for its commit (collective; it raises on every rank alike when the save fails),
    ``committed`` lists the committed steps now and ``settled`` once the step's writer had its
    chance (both collective), ``record(event, **fields)`` writes the event (rank 0) and says whether
    the step is committed. Returns the stop to raise."""
    start = time.monotonic()
    durable = step == 0 or step in committed()
    if not durable:
        save()
        # Another replica group may be the one that writes this step (and may not have yet).
        durable = step in settled()
    record(
        PREEMPTED_EVENT,
        step=step,
        signal=signal.Signals(signum).name,
        seconds=round(time.monotonic() - start, 3),
        committed=durable,
    )
    return Preempted(step, signum, committed=durable)


def stop_trainer(trainer: Trainer, signum: int) -> Preempted:
    """``trainer``'s stop at its current step (``Trainer._stop_preempted``): save it if this group
    writes it, wait until it is committed (by whichever group writes it), record the event."""
    from resilient.trainer.sync import LocalSync  # here: it imports torch (see ``StopFlags``)

    step, grace, wrote = trainer.step, trainer.config.run.preempt_grace_s, [False]
    steps, writes, ckpt = trainer.committed_steps, trainer.saves_this_step, trainer.checkpointer

    def save() -> None:
        wrote[0] = save_stop_step(step, wait=ckpt.wait, committed=steps, writes=writes, save=trainer.save)

    def record(event: str, **fields: Any) -> None:
        if trainer.outputs.enabled:
            write_event(trainer.config.run.dir, event, group=group_id(), wrote=wrote[0], **fields)
        ours = wrote[0] or isinstance(trainer.sync, LocalSync)  # a lone group wrote every step it has
        trainer.outputs.message(stop_line(step, committed=fields["committed"], ours=ours, grace_s=grace))

    settled = functools.partial(trainer.settled_steps, trainer.preemption.deadline(grace))
    return stop_preempted(step, signum, save=save, committed=steps, settled=settled, record=record)
