"""The trainer's side of a preemption (``Trainer._stop_preempted``), on a fake trainer: which step it
saves, and what an earlier save's failure does to that save."""

from __future__ import annotations

import contextlib
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest

from resilient.errors import CommitError
from resilient.trainer.loop import Trainer
from resilient.trainer.preempt import Preempted, PreemptWatch, preempt_signals
from resilient.trainer.sync import LocalSync


class FakeCheckpointer:
    """Commits a step when waited on after its save; ``stale`` is raised by the first wait."""

    def __init__(self, committed: list[int], stale: CommitError | None = None) -> None:
        self.committed = committed
        self.stale = stale
        self.pending: list[int] = []
        self.saved: list[int] = []

    def wait(self) -> None:
        if self.stale is not None:
            error, self.stale = self.stale, None
            raise error
        self.committed.extend(self.pending)
        self.pending = []


def _trainer(step: int, checkpointer: FakeCheckpointer, *, saved_step: int | None) -> Any:
    trainer = Trainer.__new__(Trainer)
    messages: list[str] = []

    def save() -> None:
        checkpointer.saved.append(trainer.step)
        checkpointer.pending.append(trainer.step)
        trainer._saved_step = trainer.step

    trainer.step = step
    trainer.sync = LocalSync()
    trainer._saved_step = saved_step
    trainer.checkpointer = checkpointer
    trainer.save = save
    trainer.committed_steps = lambda: sorted(checkpointer.committed)
    trainer.settled_steps = lambda deadline: sorted(checkpointer.committed)
    trainer.saves_this_step = lambda: True
    trainer.config = SimpleNamespace(run=SimpleNamespace(preempt_grace_s=5.0, dir=""))
    trainer.observer = SimpleNamespace(paused=contextlib.nullcontext)
    trainer.preemption = PreemptWatch(preempt_signals(""))
    trainer.outputs = SimpleNamespace(enabled=False, message=messages.append, messages=messages)
    return trainer


@pytest.mark.timeout(10)
def test_a_step_restored_from_ram_is_saved_when_preempted_at_once() -> None:
    # resume() from RAM sets _saved_step to the restored step, which is in RAM only.
    checkpointer = FakeCheckpointer(committed=[4])
    trainer = _trainer(6, checkpointer, saved_step=6)
    stop = trainer._stop_preempted(signal.SIGTERM)
    assert isinstance(stop, Preempted) and stop.step == 6
    assert checkpointer.saved == [6] and checkpointer.committed == [4, 6]
    assert trainer.outputs.messages == ["preempted: step 6 is committed; exiting 143 to be resumed"]


@pytest.mark.timeout(10)
def test_a_committed_step_is_not_saved_again() -> None:
    checkpointer = FakeCheckpointer(committed=[6])
    trainer = _trainer(6, checkpointer, saved_step=6)
    assert trainer._stop_preempted(signal.SIGTERM).step == 6
    assert checkpointer.saved == []


@pytest.mark.timeout(10)
def test_an_earlier_failed_save_does_not_stop_the_stop_step_being_saved() -> None:
    # A background save of step 4 failed; the first wait raises that (stale) error on every rank.
    checkpointer = FakeCheckpointer(committed=[2], stale=CommitError("step 4: disk full"))
    trainer = _trainer(5, checkpointer, saved_step=4)
    assert trainer._stop_preempted(signal.SIGTERM).step == 5
    assert checkpointer.saved == [5] and checkpointer.committed == [2, 5]


@pytest.mark.timeout(10)
def test_a_replica_group_that_did_not_write_the_step_does_not_say_it_committed_it() -> None:
    checkpointer = FakeCheckpointer(committed=[6])  # a peer group committed step 6
    trainer = _trainer(6, checkpointer, saved_step=None)
    trainer.sync = object()  # not LocalSync: one of several replica groups
    trainer.saves_this_step = lambda: False
    trainer._stop_preempted(signal.SIGTERM)
    assert checkpointer.saved == []
    assert trainer.outputs.messages == ["preempted: step 6 is committed (by a peer group); exiting 143 to be resumed"]


@pytest.mark.timeout(10)
def test_a_replica_group_that_never_sees_the_step_committed_stops_with_exit_1_not_143() -> None:
    checkpointer = FakeCheckpointer(committed=[4])  # the writing group did not commit step 6
    trainer = _trainer(6, checkpointer, saved_step=None)
    trainer.sync = object()
    trainer.saves_this_step = lambda: False
    waited: list[float] = []
    trainer.settled_steps = lambda deadline: waited.append(deadline) or [4]
    # The SIGTERM came 3 s before the stop step ended: torchrun kills at signal + grace + a margin.
    trainer.preemption.received, trainer.preemption.received_at = signal.SIGTERM, time.monotonic() - 3.0
    stop = trainer._stop_preempted(signal.SIGTERM)
    assert stop.step == 6 and stop.committed is False
    assert waited == [trainer.preemption.received_at + 5.0]  # run.preempt_grace_s from the signal on
    assert checkpointer.saved == []
    (line,) = trainer.outputs.messages
    assert line.startswith("preempted: step 6 is not committed") and "run.preempt_grace_s=5" in line
    assert "exiting 1" in line
