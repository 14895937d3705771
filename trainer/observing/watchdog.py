"""A per-rank hang watchdog: when no step commits for ``timeout_s``, dump every thread's stack.

A rank stuck in a collective (a peer died, a NCCL/gloo call that never returns) or in storage I/O
shows nothing in the logs: the training thread is blocked and no step record comes. The watchdog
is one daemon thread that notices the silence and writes the Python stacks of all threads to
``<directory>/hang/rank<R>-<incarnation>.txt`` (``directory`` is the group folder,
``<run.dir>/group<G>``), so a hang says *where* each rank waits (docs/observability.md, ``hang``).

It only observes: it never raises into the training thread and never ends the process (the
collective's own timeout, or torchrun, does that). ``beat`` is the only call on the hot path.

Usage::

    watchdog = HangWatchdog(group_dir, group=g, rank=r, incarnation=i, timeout_s=300, on_hang=emit)
    watchdog.start()
    with watchdog.paused():
        restore()
    for step in ...:
        train_step(); watchdog.beat(step)
    watchdog.stop()
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

HANG_DIR = "hang"
"""Folder under the group folder that holds the stack dumps (and the NCCL flight-recorder dumps)."""
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"
"""torch appends the process group's global rank to this prefix when it dumps its flight recorder."""
FLIGHT_RECORDER_BUFFER = 2000
"""Entries in the NCCL flight recorder's ring buffer (torch's own default in FlightRecorder.hpp)."""


def hang_path(directory: str, rank: int, incarnation: int) -> str:
    """Where rank ``rank`` of incarnation ``incarnation`` writes its stacks."""
    return os.path.join(directory, HANG_DIR, f"rank{rank}-{incarnation}.txt")


def flight_recorder_env(directory: str) -> dict[str, str]:
    """Environment that makes torch's NCCL flight recorder dump into ``<directory>/hang/`` on a
    collective timeout (one ``nccl_trace_rank_<global rank>`` file per rank).

    Set it before the process group is created (ProcessGroupNCCL reads it at construction), e.g. in
    the launcher's environment. Creates the folder: torch does not, and a dump into a missing folder
    is lost silently. Harmless without CUDA (gloo ignores it).

    Names checked against the installed torch 2.13:
    - ``TORCH_NCCL_TRACE_BUFFER_SIZE``: torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp
      (and FlightRecorder.hpp, which also accepts the newer alias ``TORCH_FR_BUFFER_SIZE``);
      the recorder is off when it is 0, the default that distributed_c10d.py reads.
    - ``TORCH_NCCL_DUMP_ON_TIMEOUT``: ProcessGroupNCCL.hpp ("must be set together with
      TORCH_NCCL_ENABLE_MONITORING=1", which is torch's default, "and TORCH_NCCL_TRACE_BUFFER_SIZE > 0").
    - ``TORCH_FR_DUMP_TEMP_FILE``: only in the compiled library (``strings lib/libtorch_cpu.so``),
      next to its older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; both are set so an older torch
      dumps into the same place instead of /tmp/nccl_trace_rank_.
    """
    folder = os.path.join(directory, HANG_DIR)
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, FLIGHT_RECORDER_PREFIX)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_BUFFER),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


class HangWatchdog:
    """Watches one rank's step beats from a daemon thread named ``hang-watchdog-rank<R>``.

    Args:
        directory: the group folder (``<run.dir>/group<G>``); dumps go to ``<directory>/hang/``.
        group, rank, incarnation: who this is (rank within the group, as in the file name).
        timeout_s: seconds without a beat (while not paused) that count as a hang.
        on_hang: called once per hang, from the watchdog thread, with
            ``{"event": "hang", "group", "rank", "step", "idle_s", "path"}``; ``step`` is the last
            beaten step (None before the first beat), ``path`` is the dump's path relative to the
            parent of ``directory`` (the run dir: ``group0/hang/rank1-0.txt``). Its errors are logged.
    """

    def __init__(
        self,
        directory: str,
        *,
        group: int,
        rank: int,
        incarnation: int,
        timeout_s: float,
        on_hang: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"HangWatchdog timeout_s={timeout_s!r} must be > 0 seconds")
        self.directory = directory
        self.group = group
        self.rank = rank
        self.incarnation = incarnation
        self.timeout_s = float(timeout_s)
        self.check_every_s = min(1.0, self.timeout_s / 4)
        self.on_hang = on_hang
        self.path = hang_path(directory, rank, incarnation)
        self.hangs = 0
        """Hang episodes seen so far."""
        self.error: BaseException | None = None
        """The first error inside the watchdog (logged once; kept, not raised: a diagnostic that
        fails must not take a training run down with it)."""
        # One tuple, replaced whole: a single attribute store is atomic under the GIL, so the
        # watcher never sees a step from one beat with the time of another, and beat needs no lock.
        self._beat: tuple[int | None, float] = (None, time.monotonic())
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the training thread's side -----------------------------------------------------------

    def start(self) -> None:
        """Start watching; the first window runs from now."""
        if self._thread is not None:
            return
        self._stop.clear()  # a stopped watchdog may be started again
        self._beat = (self._beat[0], time.monotonic())
        self._thread = threading.Thread(target=self._run, name=f"hang-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        """A step committed. One tuple store; time.monotonic is served by the vDSO on Linux (no
        system call), so this costs well under a microsecond."""
        self._beat = (step, time.monotonic())

    def pause(self) -> None:
        """Stop counting silence (a restore or a final save may legitimately take long). Nests."""
        self._paused += 1

    def resume(self) -> None:
        """Count again, from now: the paused time is not idle time."""
        self._beat = (self._beat[0], time.monotonic())
        self._paused = max(0, self._paused - 1)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread; True if it ended within ``timeout_s`` (it is a daemon either way)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("[rank %d] hang watchdog did not stop within %.1f s", self.rank, timeout_s)
            return False
        return True

    def __enter__(self) -> HangWatchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the watchdog thread ------------------------------------------------------------------

    def _run(self) -> None:
        fired_for: tuple[int | None, float] | None = None
        while not self._stop.wait(self.check_every_s):
            beat = self._beat
            idle_s = time.monotonic() - beat[1]
            # fired_for is the beat a hang was reported for: the next beat (or a resume) is a new
            # tuple, which re-arms the watchdog; the same silence is reported once.
            if self._paused or idle_s < self.timeout_s or fired_for is beat:
                continue
            fired_for = beat
            self.hangs += 1
            try:
                self._report(beat[0], idle_s)
            except Exception as e:  # noqa: BLE001 - a diagnostic must not kill the run; kept and logged once
                self._latch(e)

    def _report(self, step: int | None, idle_s: float) -> None:
        # The first hang of an incarnation is rank<R>-<inc>.txt; a later one gets its number, so
        # each event's path names its own dump.
        path = self.path if self.hangs <= 1 else f"{self.path[: -len('.txt')]}-{self.hangs}.txt"
        _write_stacks(path)
        relative = os.path.relpath(path, os.path.dirname(os.path.abspath(self.directory)))
        logger.warning(
            "[rank %d] no step for %.1f s after step %s (timeout %.1f s): stacks of all threads in %s",
            self.rank,
            idle_s,
            step,
            self.timeout_s,
            path,
            extra={"event": "hang", "group": self.group, "rank": self.rank, "step": step, "idle_s": idle_s},
        )
        if self.on_hang is not None:
            event = {
                "event": "hang",
                "group": self.group,
                "rank": self.rank,
                "step": step,
                "idle_s": round(idle_s, 3),
                "path": relative,
            }
            self.on_hang(event)

    def _latch(self, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = error
        logger.warning(
            "[rank %d] hang watchdog failed while reporting a hang to %s: %r",
            self.rank,
            self.path,
            error,
            exc_info=error,
        )


def format_stacks() -> str:
    """The Python stack of every thread, named (``threading`` names; the ident when unnamed)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    sections = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, "<unnamed>")
        sections.append(f"--- thread {name} (ident {ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(sections)


def _write_stacks(path: str) -> None:
    """Both views, atomically (temp + rename: a reader never sees half a dump). faulthandler's is
    the second section: it reads frames without the interpreter's help, so it also shows threads
    that the first section's formatting could not (and it writes to the fd directly, hence the flush)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"# Python stacks of all threads, pid {os.getpid()}, t={time.time():.3f}\n\n")
        f.write(format_stacks())
        f.write("\n# faulthandler.dump_traceback(all_threads=True)\n\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.flush()
    os.replace(tmp, path)
