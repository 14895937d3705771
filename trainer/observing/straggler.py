"""Which rank is slow, found without knowing where the collectives are.

Comparing each rank's wall time per phase cannot name a rank that is slow from outside (stopped,
throttled, starved by a noisy neighbour) once collectives sit inside the phases: under FSDP the
all-gathers and reduce-scatters run inside forward and backward, under TP inside every block, under
PP a stage waits on its neighbour, so the rank that waits shows the same long phase as the rank it
waits for. Two measures do not depend on the collectives:

- ``StallClock``: the time this process did not run although it wanted to. A daemon thread sleeps
  a short tick and counts how late it wakes beyond a margin: a SIGSTOPped process, a cgroup CPU
  quota, a starved host hold every thread of the process alike, wherever its main thread is (inside
  a collective or not). A rank waiting for a peer is blocked, not held: its ticker wakes on time.
- arrival lateness at the window's sync point (``gather_window``'s all-gather, which this module
  does not place): each rank's arrival time there against the earliest rank's (evidence).

``StragglerWatch`` runs on rank 0 of a group over every window: a rank whose stalled time exceeds
its peers' median by ``STALL_SHARE`` of the step, or whose own work phase (compute, data wait,
checkpoint stall) does by ``factor`` and ``MIN_STEP_SHARE`` of the step (in its mean and, for data
wait and compute, in its per-step median over the window), for ``windows`` consecutive windows
starts an episode (reported once, with its evidence); the episode clears after ``windows``
consecutive windows in which that rank is slow in nothing. ``GroupWatch`` does the same for a
replica group held as a whole, against the other groups.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

TICK_S = 0.01
"""How often the stall ticker wakes: 100 wake-ups a second, tens of microseconds of CPU each."""
LATE_MARGIN_S = 0.008
"""A wake-up later than this beyond its tick counts as stalled time. Above the interpreter's GIL
switch interval (5 ms, the longest a ready thread waits for Python code of the main thread) and the
scheduler's usual latency, so only real holds count; a stop or a throttled period lasts far longer."""

WATCHED = ("compute_s", "data_wait_s", "ckpt_stall_s")
"""Phases a rank spends on its own work. Not step_s (the collectives make it the same on every
rank) nor grad_sync_s (long there means waiting FOR a straggler, the victim's side)."""
STALLED = "stalled_s"
"""The reason of an episode found by the stall clock."""
MIN_PHASE_S = 1e-3
"""Below a millisecond a phase is noise: ratios of such times flag nobody."""
MIN_STEP_SHARE = 0.25
"""A phase straggler's excess over its peers' median is at least this share of the step time. A
quarter: on an overloaded host a rank's loader worker (a process of its own, first to be starved)
can lag its peers' by a fifth of the step for several windows, in a run where nothing is wrong."""
STALL_SHARE = 0.15
"""A rank stalled longer than its peers' median by this share of the step is held from outside. A
rank stopped 30% of the time shows about 0.3; an overloaded host's scheduling delays, spread over
every rank, stay well below (docs/observability.md)."""


class StallClock:
    """Seconds this process was held (not running while it wanted to), summed since the start."""

    def __init__(self, tick_s: float = TICK_S, margin_s: float = LATE_MARGIN_S) -> None:
        self.tick_s = tick_s
        self.margin_s = margin_s
        self._held = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilient-stall-clock", daemon=True)

    def start(self) -> StallClock:
        self._thread.start()
        return self

    def _run(self) -> None:
        tick, margin = self.tick_s, self.margin_s
        before = time.monotonic()
        while not self._stop.is_set():
            time.sleep(tick)  # not Event.wait: a plain sleep costs the fewest microseconds a wake-up
            now = time.monotonic()
            late = now - before - tick
            if late > margin:
                self._held += late  # one writer (this thread); readers take a float, atomic in CPython
            before = now

    def held_s(self) -> float:
        return self._held

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


@dataclass
class _Episode:
    phase: str
    first_step: int
    started_step: int
    started_t: float
    clean: int = 0


@dataclass
class _Episodes:
    """Per key (a rank, a group): ``windows`` slow windows in a row open an episode, as many windows
    slow in nothing close it."""

    windows: int
    _streak: dict[int, int] = field(default_factory=dict)
    _first: dict[int, int] = field(default_factory=dict)
    _open: dict[int, _Episode] = field(default_factory=dict)

    def update(self, key: int, slow: dict[str, Any] | None, step: int) -> dict[str, Any] | None:
        """The episode's start ({"event": "straggler", **slow}) or end, or None."""
        if slow is not None:
            self._streak[key] = self._streak.get(key, 0) + 1
            self._first.setdefault(key, step)
        else:
            self._streak[key] = 0
            self._first.pop(key, None)
        episode = self._open.get(key)
        if episode is None:
            if slow is not None and self._streak[key] == self.windows:
                self._open[key] = _Episode(slow["phase"], self._first[key], step, time.time())
                return {"event": "straggler", **slow}
            return None
        episode.clean = 0 if slow is not None else episode.clean + 1
        if episode.clean < self.windows:
            return None
        del self._open[key]
        return {
            "event": "straggler_cleared",
            "phase": episode.phase,
            "started_step": episode.started_step,
            "first_slow_step": episode.first_step,
            "duration_steps": step - episode.first_step,
            "duration_s": round(time.time() - episode.started_t, 3),
        }

    def open_keys(self) -> dict[int, str]:
        return {key: e.phase for key, e in self._open.items()}


@dataclass
class StragglerWatch:
    """On rank 0 of a group: ``check`` gets each window's ranks and returns what just started or ended."""

    factor: float
    windows: int
    _episodes: _Episodes = field(init=False)

    def __post_init__(self) -> None:
        self._episodes = _Episodes(self.windows)

    def check(self, ranks: list[dict[str, float]], step: int = 0) -> list[dict[str, Any]]:
        """[{"event": "straggler", rank, phase, ratio, evidence...}] for episodes that start at this
        window, [{"event": "straggler_cleared", rank, phase, ...}] for those that end."""
        out = []
        step_s = statistics.median(r["step_s"] for r in ranks)
        for entry in ranks:
            rank = int(entry["rank"])
            slow = self._slowest(entry, ranks, step_s)
            change = self._episodes.update(rank, slow, step)
            if change is not None:
                evidence = _lateness(entry, ranks) if change["event"] == "straggler" else {}
                out.append({"event": change.pop("event"), "rank": rank, **change, **evidence})
        return out

    def open_episodes(self) -> dict[int, str]:
        """rank -> phase of the episodes not cleared yet."""
        return self._episodes.open_keys()

    def _slowest(self, entry: dict[str, float], ranks: list[dict[str, float]], step_s: float) -> dict[str, Any] | None:
        """The rank's largest slowness this window (by excess over its peers' median), or None."""
        best = None
        for phase in (STALLED, *WATCHED):
            if phase not in entry:
                continue
            peers = [float(r.get(phase, 0.0)) for r in ranks if r["rank"] != entry["rank"]]
            median = statistics.median(peers) if peers else float(entry[phase])
            value = float(entry[phase])
            excess = value - median
            if phase == STALLED:
                slow = excess >= STALL_SHARE * step_s and value >= MIN_PHASE_S
            else:
                slow = self._slow(value, median, step_s)
                typical = f"{phase}_p50"
                if slow and typical in entry:  # in most steps of the window, not in one that a busy host delayed
                    peers_typical = statistics.median(float(r.get(typical, 0.0)) for r in ranks if r is not entry)
                    slow = self._slow(float(entry[typical]), peers_typical, step_s)
            if slow and (best is None or excess > best["excess_s"]):
                best = {
                    "phase": phase,
                    "ratio": round(_ratio(value, median), 3),
                    "value_s": round(value, 6),
                    "median_s": round(median, 6),
                    "excess_s": round(excess, 6),
                    "share": round(excess / step_s, 4) if step_s > 0 else 0.0,
                    "step_s": round(step_s, 6),
                }
        return best

    def _slow(self, value: float, median: float, step_s: float) -> bool:
        # Slow by the factor AND by a share of the step that matters (2 ms against 1 ms of data
        # wait is a ratio of 2, and nothing anyone should act on).
        return _ratio(value, median) >= self.factor and value - median >= MIN_STEP_SHARE * step_s


class GroupWatch:
    """On rank 0 of each replica group: whether this group AS A WHOLE is held, against the others.

    A group whose every rank is held alike (its host throttled) names nobody inside it; the other
    groups wait for it in the cross-group all-reduce. Its held time is its least-stalled rank's
    (held as a whole means every rank), compared with the other groups' at their newest window,
    read from their ``ranks.jsonl`` (the groups share run.dir, as they share events.jsonl). Each
    group judges only itself, so one event names a slow group, written by that group."""

    def __init__(self, group: int, paths: dict[int, str], windows: int, window_steps: int) -> None:
        from resilient.runfiles import JsonlTail

        self.group = group
        self.window_steps = window_steps
        self._tails = {g: JsonlTail(path) for g, path in paths.items() if g != group}
        self._newest: dict[int, dict[str, Any]] = {}
        self._episodes = _Episodes(windows)

    def check(self, ranks: list[dict[str, float]], step: int, steps: int) -> list[dict[str, Any]]:
        """``steps``: how many steps this window holds (a partial one, this group's first after it
        joined, is left out as the peers' are)."""
        mine = _held_as_a_whole(ranks)
        if mine is None or steps < self.window_steps:
            return []
        for g, tail in self._tails.items():
            for record in tail.poll():
                # A partial window is a group's first after it joined or restarted: its start-up
                # (imports, heal) reads as stalled time, nothing to compare with.
                if "step" in record and record.get("steps", 0) >= self.window_steps:
                    self._newest[g] = record
        # Groups in the quorum commit the same steps: a peer's newest window within a window of this
        # step compares (it may not be written yet, or be one ahead); a peer out of the quorum does not.
        peers = [
            held
            for record in self._newest.values()
            if abs(int(record["step"]) - step) < 2 * self.window_steps
            and (held := _held_as_a_whole(record.get("ranks", []))) is not None
        ]
        if not peers:
            return []
        median = statistics.median(peers)
        step_s = statistics.median(r["step_s"] for r in ranks)
        slow = None
        if mine - median >= STALL_SHARE * step_s and mine >= MIN_PHASE_S:
            slow = {
                "phase": STALLED,
                "ratio": round(_ratio(mine, median), 3),
                "value_s": round(mine, 6),
                "median_s": round(median, 6),
                "excess_s": round(mine - median, 6),
                "share": round((mine - median) / step_s, 4) if step_s > 0 else 0.0,
                "step_s": round(step_s, 6),
                "groups_compared": len(peers) + 1,
            }
        change = self._episodes.update(self.group, slow, step)
        if change is None:
            return []
        return [{"event": change.pop("event"), "rank": None, "scope": "group", **change}]


def _held_as_a_whole(ranks: list[dict[str, Any]]) -> float | None:
    held = [float(r["stalled_s"]) for r in ranks if "stalled_s" in r]
    return min(held) if held else None


def _lateness(entry: dict[str, float], ranks: list[dict[str, float]]) -> dict[str, float]:
    """Evidence beside the reason: the rank's stalled time and arrival lateness against its peers'."""
    out = {}
    for key in (STALLED, "late_s"):
        if key in entry:
            peers = [float(r.get(key, 0.0)) for r in ranks if r["rank"] != entry["rank"]]
            out[key] = round(float(entry[key]), 6)
            out[f"median_{key}"] = round(statistics.median(peers), 6) if peers else out[key]
    return out


def _ratio(value: float, median: float) -> float:
    if value < MIN_PHASE_S:
        return 1.0
    return value / max(median, MIN_PHASE_S)
