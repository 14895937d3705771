"""Where each rank's step time goes, where a start's time goes, and which rank is slow.

- ``StepPhases``: per rank, the seconds of each phase of a step (data wait, forward + backward,
  gradient sync, optimizer, checkpoint stall, RAM snapshot), summed over a window of committed
  steps. ``gather_window`` brings every rank's means to rank 0 in ONE small all-gather (7 floats a
  rank) every ``metrics.rank_every`` steps, at the same step on every rank.
- ``StragglerWatch``: on rank 0, a rank whose phase time exceeds the median of its peers by
  ``metrics.straggler_factor`` for ``metrics.straggler_windows`` consecutive windows is reported,
  once per episode.
- ``StartupClock``: the phases of a start (process start -> imports -> process group -> model
  built -> restored -> first step), recorded once per incarnation.

Timing is ``time.perf_counter`` around code that runs anyway: no synchronization is added (on CUDA
a phase's time is the host's, which is what a stall costs the loop).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("step_s", "data_wait_s", "compute_s", "grad_sync_s", "optimizer_s", "ckpt_stall_s", "snapshot_s")
"""``step_s`` is the whole step; the others are its parts (the rest is bookkeeping)."""


class StepPhases:
    """Seconds per phase, summed over the committed steps of the current window."""

    def __init__(self) -> None:
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._attempt = dict.fromkeys(PHASES, 0.0)
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
        self.steps += 1
        self.discard()

    def discard(self) -> None:
        self._attempt = dict.fromkeys(PHASES, 0.0)

    def means(self) -> list[float]:
        return [self._sums[p] / max(self.steps, 1) for p in PHASES]

    def reset(self) -> None:
        self._sums = dict.fromkeys(PHASES, 0.0)
        self.steps = 0


def gather_window(phases: StepPhases, group: Any = None) -> list[dict[str, float]] | None:
    """Every rank's mean phase times over the window (collective: every rank calls it at the same
    step); the list on rank 0, None elsewhere. The window restarts."""
    mine = torch.tensor(phases.means(), dtype=torch.float64)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [torch.empty_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, mine, group=group)
    else:
        gathered = [mine]
    phases.reset()
    if dist.is_initialized() and dist.get_rank(group) != 0:
        return None
    return [
        {"rank": rank, **{p: round(v, 6) for p, v in zip(PHASES, row.tolist(), strict=True)}}
        for rank, row in enumerate(gathered)
    ]


WATCHED = ("compute_s", "data_wait_s", "ckpt_stall_s")
"""Phases a rank spends on its own work. Not step_s (the collectives make it the same on every
rank) nor grad_sync_s (long there means waiting FOR a straggler, the victim's side)."""


@dataclass
class StragglerWatch:
    factor: float
    windows: int
    _streak: dict[tuple[int, str], int] = field(default_factory=dict)

    def check(self, ranks: list[dict[str, float]]) -> list[dict[str, Any]]:
        """Stragglers that just reached ``windows`` consecutive slow windows: [{rank, ratio, phase}]."""
        found = []
        step_s = statistics.median(r["step_s"] for r in ranks)
        for phase in WATCHED:
            for entry in ranks:
                peers = [r[phase] for r in ranks if r["rank"] != entry["rank"]]
                median = statistics.median(peers) if peers else entry[phase]
                ratio = _ratio(entry[phase], median)
                key = (entry["rank"], phase)
                # Slow by the factor AND by a share of the step that matters (2 ms against 1 ms of
                # data wait is a ratio of 2, and nothing anyone should act on).
                slow = ratio >= self.factor and entry[phase] - median >= MIN_STEP_SHARE * step_s
                self._streak[key] = self._streak.get(key, 0) + 1 if slow else 0
                if slow and self._streak[key] == self.windows:
                    found.append({"rank": entry["rank"], "ratio": round(ratio, 3), "phase": phase})
        return found


MIN_PHASE_S = 1e-3
"""Below a millisecond a phase is noise: ratios of such times flag nobody."""
MIN_STEP_SHARE = 0.05
"""A straggler's excess over its peers' median is at least this share of the step time."""


def _ratio(value: float, median: float) -> float:
    if value < MIN_PHASE_S:
        return 1.0
    return value / max(median, MIN_PHASE_S)


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
