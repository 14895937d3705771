"""The handle ``Checkpointer.save`` returns: wait for the save, get its stats or its error."""

from __future__ import annotations

import threading

from resilient.errors import CommitError
from resilient.metrics import SaveStats


class SaveHandle:
    def __init__(self, step: int) -> None:
        self.step = step
        self.stats: SaveStats | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def finish(self, stats: SaveStats) -> None:
        self.stats = stats
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveStats | None:
        """Block until the step is committed (returns its stats) or failed (raises its error)."""
        if not self._done.wait(timeout):
            raise CommitError(f"save of step {self.step} still in progress after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.stats
