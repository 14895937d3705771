"""The handle ``Checkpointer.save`` returns: staged (safe to mutate the state), then committed."""

from __future__ import annotations

import threading

from resilient.errors import CommitError
from resilient.metrics import SaveStats


class SaveHandle:
    def __init__(self, step: int, staged=None, decided_by: float = 0.0) -> None:
        self.step = step
        self.decided_by = decided_by
        """Unix time by which every rank has the coordinator's decision (the agreed deadline plus
        ``decision_grace_s``); 0: unknown. A wait for the outcome must not give up before it."""
        self.attempt: str | None = None  # the save's attempt id, the same on every rank
        self.stats: SaveStats | None = None
        self.error: BaseException | None = None
        self.error_reported = False  # raised to the user (wait(), or an agreement): not again
        self._staged = staged  # a CUDA event, or None when the snapshot copy already completed
        self._done = threading.Event()

    @classmethod
    def skipped(cls, stats: SaveStats) -> SaveHandle:
        handle = cls(stats.step)
        handle.finish(stats)
        return handle

    def finish(self, stats: SaveStats) -> None:
        self.stats = stats
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the save is decided (committed or failed) without raising; False on timeout."""
        return self._done.wait(timeout)

    def set_staged(self, staged) -> None:
        """The CUDA event that marks the snapshot copy complete (None: it already is)."""
        self._staged = staged

    def wait_staged(self) -> None:
        """Block until the snapshot copy is complete: the state may be modified after this.
        (Under CUDA the copy runs on a side stream; call this right before optimizer.step().)"""
        if self._staged is not None:
            self._staged.synchronize()

    def wait(self, timeout: float | None = None) -> SaveStats | None:
        """Block until the step is committed (returns its stats) or failed (raises its error)."""
        if not self._done.wait(timeout):
            raise CommitError(f"save of step {self.step} still in progress after {timeout} s")
        if self.error is not None:
            self.error_reported = True
            raise self.error
        return self.stats
