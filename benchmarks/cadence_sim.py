"""Adaptive checkpoint cadence against fixed intervals, simulated (no training), 8 to 16,384 GPUs.

    .venv/bin/python benchmarks/cadence_sim.py [--traces 64] [--days 7] [--seed 0]

For each scale and failure trace, many random traces of ``--days`` of wall time are drawn and the
same traces are run under every policy (common random numbers):

- ``adaptive``: ``checkpoint.cadence = "adaptive"``, i.e. ``resilient.trainer.cadence_model`` fed
  with the run's own failure history (its estimator, from the Llama 3 per-node prior) and the
  tiers' costs, re-deciding after every restart and every ``DECIDE_S`` of wall time, starting
  from the hand setting ``memory_every = 100, persist_every = 500``;
- ``best_fixed``: the fixed pair of intervals with the least waste on these very traces (hindsight,
  a coordinate search over a geometric grid), per scale and trace;
- the common hand settings in ``HAND_SETTINGS`` (torchtitan's default interval is 500 steps).

``max_loss_s`` binds on every policy (no durable interval over ``MAX_LOSS_S``). Waste = 1 - useful
work / wall time, where useful work is the run's final committed step: checkpoint overhead, rework,
restores and restart downtime all count. Regret = adaptive's waste - best fixed's waste, in
percentage points. Prints one JSON line per scale and trace, then one summary line per trace.

Failure traces (per 8-GPU node, Poisson unless said otherwise; classes split by
``PRIOR_CLASS_SHARE``):

- ``llama3``: the Llama 3 report's 419 unexpected interruptions in 54 days on 16,384 GPUs
  (``LLAMA3_NODE_MTBF_S``, the estimator's prior: the prior is right);
- ``rsc``: Kokolis et al. 2024 (Meta's RSC-1 cluster, 6.5 failures per 1,000 node-days): 1.7x
  the prior's rate (the prior is wrong);
- ``chaos_repeated_kills``: the shape of ``chaos/scenarios/cadence_kills.toml``: the llama3
  background plus one bad node that kills a rank or the whole node every 20 minutes during the
  second quarter of the run, then is replaced (rates that change within a run).

Costs, per GPU of ``STATE_GIB`` of checkpoint state, from the RAM-tier measurements in
benchmarks/README.md (``ram_bench.py``, seconds per 256 MiB per rank: memcpy 0.020, own-RAM
restore 0.040, buddy restore 0.146, S3 load 0.461) and storage shared by the whole job at the
Llama 3 report's 2 TB/s: see ``costs``. Downtimes and the background slowdown are assumptions,
named in ``DOWNTIME_S`` and ``BACKGROUND_SLOWDOWN``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resilient.trainer.cadence_model import (  # noqa: E402
    CLASSES,
    HALF_LIFE_S,
    LLAMA3_NODE_MTBF_S,
    PRIOR_CLASS_SHARE,
    Bounds,
    CadenceInputs,
    FailureHistory,
    TierCost,
    estimate_rates,
    optimize,
    surviving,
)

SCALES = (8, 64, 512, 2048, 8192, 16384)
GPUS_PER_NODE = 8
STEP_S = 10.0
"""A pretraining step (weak scaling: the same per GPU at every scale)."""
STATE_GIB = 2.0
"""Checkpoint state per GPU (weights + Adam, sharded)."""
PER_256MIB = {"memcpy": 0.020, "own_restore": 0.040, "buddy_restore": 0.146, "s3_load": 0.461}
STORAGE_BYTES_PER_S = 2e12
"""Aggregate storage bandwidth shared by the job (Llama 3's Tectonic, sustained)."""
BACKGROUND_SLOWDOWN = 0.1
"""Share of a background write's duration that shows up as slower steps (an assumption)."""
DOWNTIME_S = {"process": 60.0, "node": 600.0, "job": 1200.0}
"""From a failure to training again, restore excluded: restart in place, replace a node, requeue."""
MAX_LOSS_S = 3600.0
DECIDE_S = 3600.0
MEMORY_RANGE = (1, 2000)
PERSIST_RANGE = (1, 20000)
HAND_SETTINGS = {
    "mem10_persist100": {"memory": 10, "persist": 100},
    "mem50_persist500": {"memory": 50, "persist": 500},
    "mem100_persist500": {"memory": 100, "persist": 500},
    "mem100_persist1000": {"memory": 100, "persist": 1000},
    "persist500_no_ram": {"memory": 0, "persist": 500},
}
START = HAND_SETTINGS["mem100_persist500"]
RSC_NODE_MTBF_S = 1000 / 6.5 * 86400
FLAKY_EVERY_S = 1200.0
GRID = sorted({round(1.4**i) for i in range(0, 30)})


def costs(gpus: int) -> CadenceInputs:
    """The tiers' costs at ``gpus`` GPUs (rates filled in by the caller)."""
    units = STATE_GIB * 4  # 256 MiB units per GPU
    job_bytes = gpus * STATE_GIB * 2**30
    write_s = max(units * PER_256MIB["s3_load"], job_bytes / STORAGE_BYTES_PER_S)
    buddy_copy_s = units * PER_256MIB["buddy_restore"]
    memory = TierCost(
        cost_s=units * PER_256MIB["memcpy"] + BACKGROUND_SLOWDOWN * buddy_copy_s,
        restore_s=units * PER_256MIB["own_restore"],
    )
    persist = TierCost(cost_s=units * PER_256MIB["memcpy"] + BACKGROUND_SLOWDOWN * write_s, restore_s=write_s)
    return CadenceInputs(step_s=STEP_S, memory=memory, persist=persist, downtime_s=DOWNTIME_S, buddies=gpus > 8)


# --- traces ---------------------------------------------------------------------------------------


def _poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    out, t = [], start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append(t)
    return out


def _draw_class(rng: random.Random) -> str:
    return rng.choices(CLASSES, weights=[PRIOR_CLASS_SHARE[c] for c in CLASSES])[0]


def draw_trace(kind: str, gpus: int, horizon_s: float, rng: random.Random) -> list[tuple[float, str]]:
    """Failure times (wall seconds) and classes of one run."""
    nodes = max(1, gpus // GPUS_PER_NODE)
    mtbf = RSC_NODE_MTBF_S if kind == "rsc" else LLAMA3_NODE_MTBF_S
    events = [(t, _draw_class(rng)) for t in _poisson(rng, nodes / mtbf, 0.0, horizon_s)]
    if kind == "chaos_repeated_kills":
        burst = _poisson(rng, 1 / FLAKY_EVERY_S, horizon_s / 4, horizon_s / 2)
        events += [(t, rng.choice(("process", "node"))) for t in burst]
    return sorted(events)


# --- one run --------------------------------------------------------------------------------------

Policy = Callable[[FailureHistory], dict[str, int]]


@dataclass(slots=True)
class _Run:
    inputs: CadenceInputs
    step: int = 0
    last: dict[str, int] | None = None
    partial: float = 0.0
    """The part of a step done when the last ``advance`` ended (a phase ends mid-step)."""

    def advance(self, seconds: float, every: dict[str, int]) -> None:
        """Train ``seconds`` of wall time at ``every``: checkpoint costs amortized per step, each
        tier's newest checkpoint at the last multiple of its interval (the trainer's rule)."""
        wall = self.inputs.step_s + sum(self._cost(t) / k for t, k in every.items() if k > 0)
        progress = self.partial + seconds / wall
        end = self.step + math.floor(progress)
        self.partial = progress - math.floor(progress)
        assert self.last is not None
        for tier, k in every.items():
            if k > 0 and end // k * k > self.step:
                self.last[tier] = end // k * k
        self.step = end

    def _cost(self, tier: str) -> float:
        cost = self.inputs.memory if tier == "memory" else self.inputs.persist
        assert cost is not None
        return cost.cost_s

    def fail(self, cls: str, every: dict[str, int]) -> float:
        """Back to the newest checkpoint that survives ``cls``; returns the downtime it costs."""
        assert self.last is not None
        tiers = [t for t in surviving(cls, self.inputs) if every.get(t, 0) > 0]
        tier = max(tiers, key=lambda t: (self.last[t], t == "memory"))
        self.step, self.partial = self.last[tier], 0.0
        self.last["memory"] = self.step  # RAM holds the restored step (a new timeline after storage)
        cost = self.inputs.memory if tier == "memory" else self.inputs.persist
        assert cost is not None
        return cost.restore_s + self.inputs.downtime_s[cls]


class _Recent:
    """``recent_history`` kept up to date as time passes (the same numbers, without re-summing
    every failure at every decision)."""

    def __init__(self) -> None:
        self.decay = math.log(2) / HALF_LIFE_S
        self.counts = {c: 0.0 for c in CLASSES}
        self.at = 0.0

    def __call__(self, now: float, failed: str = "") -> FailureHistory:
        factor = math.exp(-self.decay * (now - self.at))
        self.counts = {c: n * factor for c, n in self.counts.items()}
        self.at = now
        if failed:
            self.counts[failed] += 1.0
        exposure = (1.0 - math.exp(-self.decay * now)) / self.decay
        return FailureHistory(exposure_s=exposure, counts=dict(self.counts))


def simulate(
    inputs: CadenceInputs,
    trace: list[tuple[float, str]],
    horizon_s: float,
    policy: Policy,
    *,
    decide_s: float = math.inf,
) -> float:
    """Waste of one run under ``policy`` (called after every restart and every ``decide_s``)."""
    run = _Run(inputs, last={"memory": 0, "persist": 0})
    recent = _Recent()
    resume = 0.0
    for t_fail, cls in [*trace, (horizon_s, "")]:
        if t_fail < resume:
            continue  # failed again while restarting: the restart starts over, nothing more is lost
        t = resume
        while t < t_fail:
            every = policy(recent(t))
            until = min(t_fail, t + decide_s)
            run.advance(until - t, every)
            t = until
        if not cls:
            break
        resume = t_fail + run.fail(cls, policy(recent(t_fail, cls)))
    return 1.0 - run.step * inputs.step_s / horizon_s


def capped(every: dict[str, int]) -> dict[str, int]:
    """A fixed setting under ``max_loss_s``, as every policy is."""
    cap = max(1, int(MAX_LOSS_S // STEP_S))
    return {**every, "persist": min(every["persist"], cap)}


def fixed(every: dict[str, int]) -> Policy:
    setting = capped(every)
    return lambda _history: setting


def adaptive(inputs: CadenceInputs, gpus: int) -> Policy:
    bounds = Bounds(memory=MEMORY_RANGE, persist=PERSIST_RANGE, max_loss_s=MAX_LOSS_S)
    nodes = max(1, gpus // GPUS_PER_NODE)

    def decide(history: FailureHistory) -> dict[str, int]:
        rates = estimate_rates(history, LLAMA3_NODE_MTBF_S, nodes)
        return optimize(_with_rates(inputs, rates), bounds, start=START)

    return decide


def _with_rates(inputs: CadenceInputs, rates: dict[str, float]) -> CadenceInputs:
    return CadenceInputs(
        step_s=inputs.step_s,
        memory=inputs.memory,
        persist=inputs.persist,
        rates=rates,
        downtime_s=inputs.downtime_s,
        buddies=inputs.buddies,
    )


# --- the comparison -------------------------------------------------------------------------------


def mean_waste(
    inputs: CadenceInputs, traces: list, horizon_s: float, policy: Policy, decide_s: float = math.inf
) -> float:
    return statistics.fmean(simulate(inputs, trace, horizon_s, policy, decide_s=decide_s) for trace in traces)


def best_fixed(inputs: CadenceInputs, traces: list, horizon_s: float) -> tuple[dict[str, int], float]:
    """The fixed pair with the least mean waste on ``traces``: coordinate search over ``GRID``."""
    every = dict(START)
    memo: dict[tuple[int, int], float] = {}

    def cost(m: int, p: int) -> float:
        if (m, p) not in memo:
            memo[m, p] = mean_waste(inputs, traces, horizon_s, fixed({"memory": m, "persist": p}))
        return memo[m, p]

    for _ in range(3):
        every["persist"] = min(GRID, key=lambda p: cost(every["memory"], p))
        every["memory"] = min(GRID, key=lambda m: cost(m, every["persist"]))
    setting = capped(every)
    return setting, cost(every["memory"], every["persist"])


def draw_traces(kind: str, gpus: int, n_traces: int, horizon_s: float, seed: int) -> list:
    rng = random.Random(f"{seed}-{kind}-{gpus}")
    return [draw_trace(kind, gpus, horizon_s, rng) for _ in range(n_traces)]


def run_scale(gpus: int, kind: str, traces: list, horizon_s: float) -> dict:
    n_traces = len(traces)
    inputs = costs(gpus)
    adaptive_waste = mean_waste(inputs, traces, horizon_s, adaptive(inputs, gpus), DECIDE_S)
    best, best_waste = best_fixed(inputs, traces, horizon_s)
    hand = {name: mean_waste(inputs, traces, horizon_s, fixed(every)) for name, every in HAND_SETTINGS.items()}
    return {
        "bench": "cadence_sim",
        "gpus": gpus,
        "trace": kind,
        "traces": n_traces,
        "days": horizon_s / 86400,
        "failures_per_trace": round(statistics.fmean(len(t) for t in traces), 2),
        "adaptive_waste": round(adaptive_waste, 5),
        "best_fixed_waste": round(best_waste, 5),
        "best_fixed": best,
        "regret_pp": round(100 * (adaptive_waste - best_waste), 3),
        "hand_waste": {name: round(w, 5) for name, w in hand.items()},
        "memory_cost_s": round(inputs.memory.cost_s, 3) if inputs.memory else None,
        "persist_cost_s": round(inputs.persist.cost_s, 3),
        "persist_restore_s": round(inputs.persist.restore_s, 2),
    }


def single_settings(rows: list[dict], traces: dict[int, list], horizon_s: float) -> dict[str, float]:
    """Each scale's hindsight-best fixed setting used at EVERY scale: its mean waste over them."""
    out = {}
    for row in rows:
        every = row["best_fixed"]
        name = f"mem{every['memory']}_persist{every['persist']}"
        out[name] = statistics.fmean(
            mean_waste(costs(gpus), scale_traces, horizon_s, fixed(every)) for gpus, scale_traces in traces.items()
        )
    return out


def summary(kind: str, rows: list[dict], singles: dict[str, float]) -> dict:
    """Across scales: adaptive's mean waste against each hand setting's and each single fixed
    setting (a scale's hindsight best) used at every scale."""
    adaptive_mean = statistics.fmean(r["adaptive_waste"] for r in rows)
    hand = {name: statistics.fmean(r["hand_waste"][name] for r in rows) for name in HAND_SETTINGS}
    hand.update(singles)
    return {
        "bench": "cadence_sim_summary",
        "trace": kind,
        "scales": [r["gpus"] for r in rows],
        "adaptive_mean_waste": round(adaptive_mean, 5),
        "fixed_mean_waste": {name: round(w, 5) for name, w in hand.items()},
        "adaptive_beats_every_single_setting": all(adaptive_mean < w for w in hand.values()),
        "max_regret_pp": max(r["regret_pp"] for r in rows),
        "best_fixed_per_scale": {r["gpus"]: r["best_fixed"] for r in rows},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=64, help="random traces per scale and kind")
    parser.add_argument("--days", type=float, default=7.0, help="wall time of one simulated run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scales", default=",".join(map(str, SCALES)))
    parser.add_argument("--kinds", default="llama3,rsc,chaos_repeated_kills")
    args = parser.parse_args(argv)
    started = time.monotonic()
    horizon_s = args.days * 86400
    for kind in args.kinds.split(","):
        rows, traces = [], {}
        for gpus in (int(s) for s in args.scales.split(",")):
            traces[gpus] = draw_traces(kind, gpus, args.traces, horizon_s, args.seed)
            rows.append(run_scale(gpus, kind, traces[gpus], horizon_s))
            print(json.dumps(rows[-1]), flush=True)
        print(json.dumps(summary(kind, rows, single_settings(rows, traces, horizon_s))), flush=True)
    print(json.dumps({"bench": "cadence_sim_done", "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
