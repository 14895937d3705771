"""The checkpoint intervals a trainer uses, and (``checkpoint.cadence = "adaptive"``) how they
change during a run: measured costs and the run's failure history into the cadence model
(``resilient.trainer.cadence_model``), its optimum out, agreed by every rank.

Per rank, every committed step: ``observe`` the step time and what a RAM snapshot or a durable
save blocked it for. Every ``DECIDE_EVERY`` steps rank 0 ``propose``s both intervals from what it
measured and read (the failures: the ``startup`` events' causes in ``events.jsonl``, across
incarnations; restore times: the ``restore`` events) and every rank of the group takes the
proposal (``dist.agree``): the RAM interval is the group's. The durable interval is the job's (one
group writes a step, and which one can change): each group's proposal is its ``vote``, summed with
the step's other sums across the groups of the quorum, and every group applies the mean at the same
step. Fixed cadence: the configured intervals, nothing measured or agreed.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from typing import Any

from resilient.incarnations import failure_history
from resilient.runfiles import group_id, read_events
from resilient.trainer.cadence_model import (
    Bounds,
    CadenceInputs,
    TierCost,
    assign,
    estimate_rates,
    mtbf_s,
    optimize,
    recent_history,
    waste,
)
from resilient.trainer.config import TrainConfig

log = logging.getLogger(__name__)

TIERS = ("memory", "persist")
_DETAIL = ("cost_s", "restore_s", "mtbf_s", "waste", "waste_fixed", "step_s")
"""The fields of a ``cadence`` event that say what its interval was chosen from."""

DECIDE_EVERY = 10
"""Steps between two decisions (one small broadcast within the group each time)."""
WINDOW = 200
"""Steps (and checkpoints) of measurements the costs are computed from: recent enough to follow a
change (a bigger batch, a slower bucket), long enough to average out one slow step."""
MIN_SAMPLES = 1
"""Checkpoints of a tier measured before its cost is used (until then its interval stays)."""
MIN_SLOWDOWN_SAMPLES = 5
"""Steps after a checkpoint, and clean steps, measured before the slowdown counts in the cost."""


class CostMeter:
    """What each tier costs per checkpoint: the time it blocked the step, plus how much slower the
    next step ran than a step after no checkpoint (its background work on a shared host)."""

    def __init__(self) -> None:
        self.blocked: dict[str, deque[float]] = {t: deque(maxlen=WINDOW) for t in ("memory", "persist")}
        self.after: dict[str, deque[float]] = {t: deque(maxlen=WINDOW) for t in ("memory", "persist")}
        self.clean: deque[float] = deque(maxlen=WINDOW)
        self._previous: tuple[str, ...] = ()

    @property
    def measured(self) -> bool:
        """Some checkpoint was measured."""
        return any(self.blocked.values())

    def observe(self, step_s: float, blocked: dict[str, float]) -> None:
        """One committed step: its wall time and each tier's blocked seconds (tiers that ran only)."""
        net = max(0.0, step_s - sum(blocked.values()))
        if not self._previous and not blocked:
            self.clean.append(net)
        for tier in self._previous:
            self.after[tier].append(net)
        for tier, seconds in blocked.items():
            self.blocked[tier].append(seconds)
        self._previous = tuple(blocked)

    def step_s(self) -> float | None:
        """The step time without checkpoints (median of clean steps; any step while none is clean)."""
        pool = self.clean or self.after["memory"] or self.after["persist"]
        return statistics.median(pool) if pool else None

    def cost_s(self, tier: str) -> float | None:
        if len(self.blocked[tier]) < MIN_SAMPLES:
            return None
        cost = statistics.fmean(self.blocked[tier])
        # Medians: one step slowed by something else (a neighbour, a page-cache flush) must not
        # read as the tier's cost; with too few samples the slowdown is not counted yet.
        if len(self.clean) >= MIN_SLOWDOWN_SAMPLES and len(self.after[tier]) >= MIN_SLOWDOWN_SAMPLES:
            cost += max(0.0, statistics.median(self.after[tier]) - statistics.median(self.clean))
        return cost


class Cadence:
    """The intervals of one rank's trainer (the same on every rank of its group, see the module)."""

    @classmethod
    def for_run(cls, config: TrainConfig, *, world: int) -> Cadence:
        """This group's cadence: its nodes from ``recovery.ranks_per_node`` (else torchrun's
        ``LOCAL_WORLD_SIZE``); buddies when it has more than one node."""
        per_node = config.recovery.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        nodes = max(1, world // max(1, per_node))
        return cls(config, group=group_id(), nodes=nodes, buddies=nodes > 1)

    def __init__(self, config: TrainConfig, *, group: int, nodes: int, buddies: bool) -> None:
        c = config.checkpoint
        self.adaptive = c.cadence == "adaptive"
        self.every = {"memory": c.memory_every, "persist": c.persist_every}
        self.start = dict(self.every)
        self.bounds = Bounds(
            memory=tuple(c.memory_every_range), persist=tuple(c.persist_every_range), max_loss_s=c.max_loss_s
        )
        self.run_dir, self.group, self.nodes, self.buddies = config.run.dir, group, nodes, buddies
        self.mtbf_prior_s = c.mtbf_prior_s
        self.meter = CostMeter()
        self.vote = float(c.persist_every)
        """This group's durable interval proposal, summed across groups with each step's sums."""
        self.detail: dict[str, dict[str, float]] = {}
        """What the last proposal was made from, per tier (the ``cadence`` event's fields)."""
        self.restore_s: dict[str, list[float]] = {"memory": [], "persist": []}
        self._history: tuple[float | None, list[tuple[float, str]]] | None = None
        self._decided_at = 0
        self._downtime_s = 0.0
        self._last: dict[str, dict[str, Any]] = {}
        """The group's last ``cadence`` event per tier in earlier incarnations (read with the history)."""

    @property
    def memory_every(self) -> int:
        return self.every["memory"]

    @property
    def persist_every(self) -> int:
        return self.every["persist"]

    def started(self, step: int) -> None:
        """The trainer (re)starts at ``step``: the next decision is ``DECIDE_EVERY`` steps on."""
        self._decided_at = step

    def decides_at(self, step: int) -> bool:
        """Whether every rank decides at ``step``: ``DECIDE_EVERY`` steps after the last decision
        and once a checkpoint was measured since this start (a restart at step 8 that is killed
        again at 17 must not always decide at 10, before its first snapshot). The same on every
        rank: the ranks checkpoint at the same steps."""
        if not self.adaptive or step - self._decided_at < DECIDE_EVERY or not self.meter.measured:
            return False
        self._decided_at = step
        return True

    # -- measurements --------------------------------------------------------------------------

    def observe(self, step_s: float, blocked: dict[str, float]) -> None:
        if self.adaptive:
            self.meter.observe(step_s, blocked)

    def restored(self, source: str, seconds: float) -> None:
        """This start's restore: its seconds are what a restore from that tier costs."""
        tier = {"own": "memory", "buddy": "memory", "persistent": "persist"}.get(source)
        if tier is not None and seconds > 0:
            self.restore_s[tier].append(seconds)

    def _read_history(self) -> tuple[float | None, list[tuple[float, str]]]:
        """The group's failures across incarnations, and the restore and restart times of the run
        (read once, on the rank that proposes: this incarnation's own failures cannot change)."""
        if self._history is None:
            events = read_events(self.run_dir)
            self._history = failure_history(events, self.group)
            self.restore_s = {"memory": [], "persist": []}
            for e in events:
                if e.get("event") == "restore" and e.get("group", self.group) == self.group and e.get("rank") == 0:
                    self.restored(str(e.get("source")), float(e.get("seconds", 0.0) or 0.0))
            starts = [
                float(e.get("total_s", 0.0) or 0.0)
                for e in events
                if e.get("event") == "startup" and e.get("group", self.group) == self.group
            ]
            self._downtime_s = statistics.fmean(starts) if starts else 0.0
            for e in events:
                if e.get("event") == "cadence" and e.get("group", self.group) == self.group and e.get("tier") in TIERS:
                    self._last[e["tier"]] = e
        return self._history

    def _cost_s(self, tier: str) -> float | None:
        """The tier's measured cost, else the one the last incarnation measured (a restarted run
        does not wait for new samples before it can decide)."""
        measured = self.meter.cost_s(tier)
        if measured is not None:
            return measured
        last = self._last.get(tier, {}).get("cost_s")
        return float(last) if isinstance(last, int | float) else None

    def resumed(self) -> dict[str, Any]:
        """Rank 0 at a (re)start: the intervals the run had reached before it (its last ``cadence``
        events), to be taken by every rank (``take``); the configured start on a first start."""
        self._read_history()
        self._history = None  # read again at the first decision: this start's own startup is not written yet
        every = dict(self.every)
        for tier, event in self._last.items():
            if isinstance(event.get("every_steps"), int) and (tier != "memory" or self.start["memory"] > 0):
                every[tier] = event["every_steps"]
        detail = {tier: {k: v for k, v in e.items() if k in _DETAIL} for tier, e in self._last.items()}
        return {"every": every, "detail": {t: {**d, "resumed": True} for t, d in detail.items()}}

    # -- decisions -----------------------------------------------------------------------------

    def inputs(self, now: float | None = None) -> CadenceInputs | None:
        """The model's inputs from what was measured and read; None until a tier's cost is known.
        A durable cost not measured yet (the first save is many steps away) leaves that interval
        where it is: its range is pinned (``bounds``) and RAM, always the cheaper tier to restore
        from, serves whatever it survives."""
        start, failures = self._read_history()
        step_s, persist, memory_cost = self.meter.step_s(), self._cost_s("persist"), self._cost_s("memory")
        on = self.start["memory"] > 0
        if step_s is None or step_s <= 0 or (persist is None and (not on or memory_cost is None)):
            return None
        now = time.time() if now is None else now
        rates = estimate_rates(recent_history(failures, start or now, now), self.mtbf_prior_s, self.nodes)
        memory = None
        if on:
            if memory_cost is None:
                return None
            memory = TierCost(memory_cost, _mean_or(self.restore_s["memory"], memory_cost))
        if persist is None:
            assert memory is not None
            persist_tier = TierCost(memory.cost_s, memory.restore_s)
        else:
            persist_tier = TierCost(persist, _mean_or(self.restore_s["persist"], persist))
        downtime = dict.fromkeys(rates, self._downtime_s)
        return CadenceInputs(step_s, persist_tier, memory, rates, downtime, self.buddies)

    def bounds_now(self) -> Bounds:
        """The configured bounds, with the durable interval pinned while its cost is unknown."""
        if self._cost_s("persist") is not None:
            return self.bounds
        here = self.every["persist"]
        return Bounds(memory=self.bounds.memory, persist=(here, here), max_loss_s=self.bounds.max_loss_s)

    def propose(self, now: float | None = None) -> dict[str, Any]:
        """Rank 0: the intervals the model chooses now, and what they were chosen from (JSON). A
        proposal that fails (a damaged history line, a numeric corner) keeps the intervals: the
        cadence is advice, and ``dist.agree`` would otherwise end training on every rank."""
        try:
            return self._propose(now)
        except Exception as e:  # noqa: BLE001 - logged; the current intervals stay
            log.warning("adaptive cadence kept its intervals: the proposal failed: %r", e)
            return {"every": dict(self.every), "detail": {}}

    def _propose(self, now: float | None) -> dict[str, Any]:
        inputs = self.inputs(now)
        if inputs is None:
            return {"every": dict(self.every), "detail": {}}
        every = optimize(inputs, self.bounds_now(), start=self.every)
        detail = {}
        assignment = assign(inputs, every)
        for tier in every:
            cost = inputs.memory if tier == "memory" else inputs.persist
            assert cost is not None
            served = tuple(c for c, t in assignment.items() if t == tier)
            detail[tier] = {
                "cost_s": round(cost.cost_s, 6),
                "restore_s": round(cost.restore_s, 6),
                "mtbf_s": round(mtbf_s(inputs.rates, served), 1) if served else None,
                "waste": round(waste(inputs, every), 6),
                "waste_fixed": round(waste(inputs, {**self.start, "memory": self.start["memory"] or 1}), 6),
                "step_s": round(inputs.step_s, 6),
            }
        return {"every": {t: every.get(t, self.every[t]) for t in self.every}, "detail": detail}

    def take(self, proposal: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank of the group: the agreed proposal's RAM interval now, its durable one as this
        group's vote. Returns the ``cadence`` events of what changed (the RAM tier's)."""
        self.detail = proposal.get("detail", {})
        self.vote = float(proposal["every"]["persist"])
        return self._set("memory", int(proposal["every"]["memory"])) if self.start["memory"] > 0 else []

    def voted(self, total: float, count: float) -> list[dict[str, Any]]:
        """Every rank of every group in the quorum: the job's durable interval is the mean vote
        (the same sums everywhere, so the same interval)."""
        if not self.adaptive or count <= 0:
            return []
        return self._set("persist", max(1, round(total / count)))

    def _set(self, tier: str, every: int) -> list[dict[str, Any]]:
        if every == self.every[tier]:
            return []
        previous, self.every[tier] = self.every[tier], every
        fields = self.detail.get(tier, {})
        return [{"tier": tier, "every_steps": every, "previous": previous, **fields}]


def _mean_or(values: list[float], default: float) -> float:
    return statistics.fmean(values) if values else default
