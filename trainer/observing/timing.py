"""Where each rank's step time goes and where a start's time goes.

- ``StepPhases``: per rank, the seconds of each phase of a step (data wait, forward + backward,
  gradient sync, optimizer, checkpoint stall, RAM snapshot), summed over a window of committed
  steps. ``gather_window`` brings every rank's means (and the per-step medians of data wait and
  compute) to rank 0 in ONE small all-gather (a dozen floats a rank) every ``metrics.rank_every``
  steps, at the same step on every rank.
  With a stall clock, each rank's stalled seconds per step and its arrival time at that
  all-gather travel with them (``resilient.trainer.observing.straggler`` names the slow rank from them).
- ``StartupClock``: the phases of a start (process start -> imports -> process group -> model
  built -> restored -> first step), recorded once per incarnation.

Timing is ``time.perf_counter`` around code that runs anyway: no synchronization is added (on CUDA
a phase's time is the host's, which is what a stall costs the loop).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("step_s", "data_wait_s", "compute_s", "grad_sync_s", "optimizer_s", "ckpt_stall_s", "snapshot_s")
"""``step_s`` is the whole step; the others are its parts (the rest is bookkeeping)."""
TYPICAL = ("data_wait_s", "compute_s")
"""Phases whose per-step median over the window travels beside the mean (``<phase>_p50``): a rank
slow in most steps, not in one step that a busy host delayed."""


class StepPhases:
    """Seconds per phase, summed over the committed steps of the current window."""

    def __init__(self) -> None:
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._attempt = dict.fromkeys(PHASES, 0.0)
        self._typical: list[list[float]] = [[] for _ in TYPICAL]
        self.steps = 0

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._attempt[phase] += time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        self._attempt[phase] += seconds

    def commit(self, step_s: float) -> None:
        """The attempt's phases count toward the window (a failed attempt's are dropped by ``discard``)."""
        self._attempt["step_s"] = step_s
        for phase in PHASES:
            self._sums[phase] += self._attempt[phase]
        for values, phase in zip(self._typical, TYPICAL, strict=True):
            values.append(self._attempt[phase])
        self.steps += 1
        self.discard()

    def discard(self) -> None:
        self._attempt = dict.fromkeys(PHASES, 0.0)

    def means(self) -> list[float]:
        return [self._sums[p] / max(self.steps, 1) for p in PHASES]

    def medians(self) -> list[float]:
        """The per-step median of each ``TYPICAL`` phase over the window (0 for an empty window)."""
        return [statistics.median(values) if values else 0.0 for values in self._typical]

    def reset(self) -> None:
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._typical = [[] for _ in TYPICAL]
        self.steps = 0


def gather_window(phases: StepPhases, held_s: float | None = None, group: Any = None) -> list[dict[str, Any]] | None:
    """Every rank's mean phase times over the window (collective: every rank calls it at the same
    step); the list on rank 0, None elsewhere. The window restarts. ``held_s``: this rank's stalled
    seconds over the window (a ``StallClock``'s difference): then each entry also has ``stalled_s``
    (per step) and ``late_s``, its arrival here after the earliest rank's (same-host clocks, or
    clocks kept within milliseconds by NTP)."""
    row = phases.means() + phases.medians()
    if held_s is not None:
        row += [held_s / max(phases.steps, 1), time.time()]
    mine = torch.tensor(row, dtype=torch.float64)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [torch.empty_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, mine, group=group)
    else:
        gathered = [mine]
    phases.reset()
    if dist.is_initialized() and dist.get_rank(group) != 0:
        return None
    rows = [r.tolist() for r in gathered]
    first = min(r[-1] for r in rows)
    out = []
    for rank, values in enumerate(rows):
        entry: dict[str, Any] = {"rank": rank, **{p: round(v, 6) for p, v in zip(PHASES, values, strict=False)}}
        typical = values[len(PHASES) : len(PHASES) + len(TYPICAL)]
        entry.update({f"{p}_p50": round(v, 6) for p, v in zip(TYPICAL, typical, strict=True)})
        if held_s is not None:
            entry["stalled_s"] = round(values[len(PHASES) + len(TYPICAL)], 6)
            entry["late_s"] = round(values[-1] - first, 6)
        out.append(entry)
    return out


class StartupClock:
    """Marks of one start, from the process's own start time."""

    def __init__(self, process_start: float) -> None:
        self.process_start = process_start
        self.marks: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.marks.setdefault(phase, time.time())

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, in order, each from the previous mark (the first from the process start)."""
        out, previous = {}, self.process_start
        for phase, at in sorted(self.marks.items(), key=lambda item: item[1]):
            out[f"{phase}_s"] = round(at - previous, 4)
            previous = at
        return out

    def total(self) -> float:
        return round(max(self.marks.values(), default=self.process_start) - self.process_start, 4)


def process_start_time() -> float:
    """When this process started (unix seconds), from the kernel's record of it."""
    import psutil

    return float(psutil.Process().create_time())
