"""The checkpoint-cadence model: how much of a run's wall time each tier's interval wastes, the
interval that wastes least, and the failure rates it is computed from. Pure functions (no torch,
no I/O): the online controller (``resilient.trainer.cadence``) and ``benchmarks/cadence_sim.py``
both use them.

The waste model is Young's first-order one (Young 1974; Daly 2006 derives the same optimum to first
order), per tier. A tier ``i`` checkpointing every ``k`` steps of ``s`` seconds costs ``C_i`` seconds
per checkpoint (blocked time plus the slowdown its background work causes), i.e. ``C_i / (k s)`` of
the wall time. Each failure class ``c`` (rate ``λ_c`` per second) is recovered from the surviving
tier that is cheapest for it (restore plus the expected rework, ``R_i + k_i s / 2``) and costs the
rework, the restore and its restart downtime ``D_c``::

    waste = Σ_i C_i / (k_i s)  +  Σ_c λ_c (k_{tier(c)} s / 2 + R_{tier(c)} + D_c)

With the assignment fixed the tiers separate, and each one's optimum is Young's
``k s = √(2 C_i / Λ_i)``, ``Λ_i`` the summed rate of the classes it serves; the assignment itself
depends on the intervals, so :func:`optimize` alternates the two until they agree.

Failure classes and the tiers that survive them: a crashed process (``process``) keeps its node's
RAM store; a lost node (``node``) keeps its buddy's copy (when buddies exist) and storage; a lost
job (``job``: every node at once, or both copies of a snapshot) keeps storage only.

Where the model is wrong (docs/cadence.md): failures are Poisson within a class (real ones come in
bursts, which the estimator only follows as they are counted); rework is half an interval on
average, not the worst case; a failure during a save is not modelled (Daly's second-order term);
the RAM interval is assumed not coarser than the durable one when both survive a failure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

TIERS = ("memory", "persist")
CLASSES = ("process", "node", "job")

LLAMA3_NODE_MTBF_S = 22_800_000.0
"""Mean time between unexpected interruptions of ONE 8-GPU node: the Llama 3 report (Dubey et al.
2024, §3.3.4) counts 419 unexpected interruptions in 54 days of pre-training on 16,384 H100s, i.e.
54 d x 86,400 s x 2,048 nodes / 419 = 2.28e7 s per node (about 264 days), a job MTBF of 3.1 h at
that scale. The default ``checkpoint.mtbf_prior_s``."""

PRIOR_CLASS_SHARE = {"process": 0.3, "node": 0.6, "job": 0.1}
"""How the prior splits interruptions by class: Llama 3 attributes 78% to hardware (GPU, HBM,
host: the node is drained and replaced, so its RAM is gone) and the rest to software, network and
maintenance, of which a crashed process restarted in place is most and whole-job losses (a switch,
a maintenance window, storage) the least. An assumption the run's own history overrides."""

PRIOR_WEIGHT = 1.0
"""How many failures' worth of evidence the prior counts as: the estimate follows the run's own
history once it has seen a failure or two (or a prior-MTBF or two without one)..."""

PRIOR_MAX_EXPOSURE_S = 6 * 3600.0
"""... but never more than this much failure-free time: a small job's prior MTBF is months, and a
prior worth months of exposure would take months to notice a node that fails every hour."""


@dataclass(frozen=True, slots=True)
class TierCost:
    """What one tier costs: per checkpoint (``cost_s``) and per restore from it (``restore_s``)."""

    cost_s: float
    restore_s: float


@dataclass(frozen=True, slots=True)
class CadenceInputs:
    """Everything the optimum depends on. ``memory`` None: the RAM tier is off."""

    step_s: float
    persist: TierCost
    memory: TierCost | None = None
    rates: Mapping[str, float] = field(default_factory=dict)
    """Failures per second of the whole job, by class (``CLASSES``)."""
    downtime_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds from a failure of each class until the job trains again, restore excluded."""
    buddies: bool = True
    """Snapshots have a copy on another node (more than one node): a lost node keeps RAM."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """``[min, max]`` steps per tier, and ``max_loss_s``: the most work a whole-job loss may cost."""

    memory: tuple[int, int] = (1, 1_000_000)
    persist: tuple[int, int] = (1, 1_000_000)
    max_loss_s: float = 0.0
    """0: no bound. Caps the durable interval (``k s <= max_loss_s``), and wins over ``persist``'s min."""


def surviving(cls: str, inputs: CadenceInputs) -> tuple[str, ...]:
    """The tiers that still hold a checkpoint after a failure of class ``cls``."""
    if inputs.memory is None or cls == "job" or (cls == "node" and not inputs.buddies):
        return ("persist",)
    return ("memory", "persist")


def _tier(inputs: CadenceInputs, tier: str) -> TierCost:
    cost = inputs.memory if tier == "memory" else inputs.persist
    assert cost is not None
    return cost


def assign(inputs: CadenceInputs, every: Mapping[str, int]) -> dict[str, str]:
    """Each failure class's recovery tier: the surviving one with the least restore plus expected
    rework at the intervals ``every`` (steps per tier)."""
    out = {}
    for cls in CLASSES:
        options = surviving(cls, inputs)
        out[cls] = min(options, key=lambda t: _tier(inputs, t).restore_s + every[t] * inputs.step_s / 2)
    return out


def waste(inputs: CadenceInputs, every: Mapping[str, int]) -> float:
    """Expected fraction of wall time lost at the intervals ``every`` (the module's formula)."""
    total = inputs.persist.cost_s / (every["persist"] * inputs.step_s)
    if inputs.memory is not None:
        total += inputs.memory.cost_s / (every["memory"] * inputs.step_s)
    for cls, tier in assign(inputs, every).items():
        rate = inputs.rates.get(cls, 0.0)
        cost = _tier(inputs, tier)
        total += rate * (every[tier] * inputs.step_s / 2 + cost.restore_s + inputs.downtime_s.get(cls, 0.0))
    return total


def tier_waste(cost_s: float, rate: float, step_s: float, every: int) -> float:
    """The part of :func:`waste` that depends on one tier's interval: its checkpoints plus the
    rework of the failures it serves (``rate``: their summed rate)."""
    interval = every * step_s
    return cost_s / interval + rate * interval / 2


def tier_optimum(cost_s: float, rate: float, step_s: float, low: int, high: int) -> int:
    """The interval in steps within ``[low, high]`` that minimizes :func:`tier_waste`: Young's
    ``√(2 C / λ)`` in steps, the better of its floor and ceiling (the waste is convex in k)."""
    if rate <= 0.0:
        return high  # nothing to recover: checkpoint as rarely as allowed
    if cost_s <= 0.0:
        return low
    best = math.sqrt(2.0 * cost_s / rate) / step_s
    candidates = {min(high, max(low, k)) for k in (math.floor(best), math.ceil(best))}
    return min(sorted(candidates), key=lambda k: tier_waste(cost_s, rate, step_s, k))


def max_loss_steps(bounds: Bounds, step_s: float) -> int | None:
    """The most steps a durable interval may span under ``max_loss_s`` (None: unbounded)."""
    if bounds.max_loss_s <= 0:
        return None
    return max(1, math.floor(bounds.max_loss_s / step_s))


def optimize(inputs: CadenceInputs, bounds: Bounds, start: Mapping[str, int] | None = None) -> dict[str, int]:
    """The intervals (steps per tier on) that minimize :func:`waste` within ``bounds``.

    Alternates: assign each class its tier at the current intervals, then each tier's Young
    optimum for the classes it serves; stops when the assignment repeats (two tiers: a few rounds).
    ``start``: the intervals to assign from first (default: each tier's lower bound)."""
    low_p, high_p = bounds.persist
    cap = max_loss_steps(bounds, inputs.step_s)
    if cap is not None:  # the durability bound wins over the range
        low_p, high_p = min(low_p, cap), min(high_p, cap)
    every = dict(start) if start else {"memory": bounds.memory[0], "persist": low_p}
    every.setdefault("memory", bounds.memory[0])
    every["persist"] = min(max(every.get("persist", low_p), low_p), high_p)
    seen: list[dict[str, str]] = []
    for _ in range(8):
        assignment = assign(inputs, every)
        if assignment in seen:
            break
        seen.append(assignment)
        load = {tier: sum(inputs.rates.get(c, 0.0) for c, t in assignment.items() if t == tier) for tier in TIERS}
        every["persist"] = tier_optimum(inputs.persist.cost_s, load["persist"], inputs.step_s, low_p, high_p)
        if inputs.memory is not None:
            every["memory"] = tier_optimum(inputs.memory.cost_s, load["memory"], inputs.step_s, *bounds.memory)
    if inputs.memory is None:
        every.pop("memory", None)
    return every


# --- failure rates ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FailureHistory:
    """What a run has seen: seconds it was exposed to failures, and failures counted per class."""

    exposure_s: float = 0.0
    counts: Mapping[str, float] = field(default_factory=dict)


HALF_LIFE_S = 24 * 3600.0
"""Failures and failure-free time count half as much a day later: rates change within a run (a
flaky node that is then replaced), and an estimate that never forgets keeps checkpointing for a
burst that is over."""


def recent_history(
    failures: list[tuple[float, str]], start_s: float, now_s: float, half_life_s: float = HALF_LIFE_S
) -> FailureHistory:
    """The history as of ``now_s`` with older evidence discounted: each failure (``(time, class)``)
    weighs ``2^-(age / half_life_s)``, and so does each second exposed since ``start_s``."""
    decay = math.log(2) / half_life_s
    counts: dict[str, float] = {}
    for t, cls in failures:
        if t <= now_s:
            counts[cls] = counts.get(cls, 0.0) + math.exp(-decay * (now_s - t))
    exposure = (1.0 - math.exp(-decay * max(0.0, now_s - start_s))) / decay
    return FailureHistory(exposure_s=exposure, counts=counts)


def prior_rates(node_mtbf_s: float, nodes: int) -> dict[str, float]:
    """The job's failure rate per class before any evidence: ``nodes / node_mtbf_s`` split by
    ``PRIOR_CLASS_SHARE`` (a job of n nodes fails n times as often as one node)."""
    job_rate = max(1, nodes) / node_mtbf_s
    return {cls: job_rate * share for cls, share in PRIOR_CLASS_SHARE.items()}


def estimate_rates(history: FailureHistory, node_mtbf_s: float, nodes: int) -> dict[str, float]:
    """Failure rate per class: the posterior mean of a Gamma prior (worth ``PRIOR_WEIGHT``
    failures or ``PRIOR_MAX_EXPOSURE_S``, centred on :func:`prior_rates`) after ``history``:
    ``(α_c + n_c) / (β + T)``. Rises with each failure counted, falls with each failure-free second."""
    prior = prior_rates(node_mtbf_s, nodes)
    beta = min(PRIOR_WEIGHT / sum(prior.values()), PRIOR_MAX_EXPOSURE_S)  # seconds of pseudo-exposure
    out = {}
    for cls, rate in prior.items():
        alpha = rate * beta
        out[cls] = (alpha + history.counts.get(cls, 0)) / (beta + max(0.0, history.exposure_s))
    return out


def mtbf_s(rates: Mapping[str, float], classes: tuple[str, ...] = CLASSES) -> float:
    """Mean time between failures of the given classes (inf when none can happen)."""
    total = sum(rates.get(c, 0.0) for c in classes)
    return math.inf if total <= 0 else 1.0 / total
