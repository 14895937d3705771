"""Slowing a process from outside: a SIGSTOP/SIGCONT duty cycle, as a thermally throttled device, a
CPU quota or a noisy neighbour slows a rank without its code knowing.

``DutyCycle(pid, duty, period_s)`` stops the process for ``duty * period_s`` of every ``period_s``
in a thread of the caller, until ``stop()`` (which always leaves the process continued). The
periods start at a random phase so that the stops fall anywhere in the rank's step, not always at
the same point of it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

PERIOD_S = 0.2
"""One stop and one run; shorter than a window of steps, longer than the scheduler's slices."""


class DutyCycle:
    def __init__(self, pid: int, duty: float, period_s: float = PERIOD_S, seed: int | None = None) -> None:
        if not 0.0 < duty < 1.0:
            raise ValueError(f"duty={duty} must be in (0, 1)")
        self.pid = pid
        self.duty = duty
        self.period_s = period_s
        self.stopped_s = 0.0
        """Seconds the process was held stopped so far."""
        self.started_t: float | None = None
        self.ended_t: float | None = None
        self._random = random.Random(seed)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"duty-cycle-{pid}", daemon=True)

    def start(self) -> DutyCycle:
        self.started_t = time.time()
        self._thread.start()
        return self

    def _run(self) -> None:
        held, free = self.duty * self.period_s, (1.0 - self.duty) * self.period_s
        if self._halt.wait(self._random.uniform(0.0, free)):
            return
        try:
            while not self._halt.is_set():
                try:
                    os.kill(self.pid, signal.SIGSTOP)
                except ProcessLookupError:
                    return
                start = time.monotonic()
                self._halt.wait(held)
                self._cont()
                self.stopped_s += time.monotonic() - start
                self._halt.wait(free)
        finally:
            self._cont()

    def _cont(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        """End the cycle; the process is continued (also when the thread is gone)."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._cont()
        self.ended_t = time.time()

    def share(self) -> float:
        """The share of the wall time it was held stopped."""
        if self.started_t is None:
            return 0.0
        end = self.ended_t if self.ended_t is not None else time.time()
        return self.stopped_s / max(end - self.started_t, 1e-9)
