"""The cadence model: each tier's optimum is the brute-force minimum of the same waste model, the
joint optimum too, the estimate follows the evidence, and ``max_loss_s`` wins."""

from __future__ import annotations

import itertools
import math

import pytest

from resilient.trainer.cadence_model import (
    Bounds,
    CadenceInputs,
    FailureHistory,
    TierCost,
    estimate_rates,
    mtbf_s,
    optimize,
    prior_rates,
    recent_history,
    tier_optimum,
    tier_waste,
    waste,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("cost_s", "rate", "step_s", "low", "high"),
    [
        (2.0, 1e-4, 1.0, 1, 2000),
        (0.3, 1 / 3600, 0.5, 1, 5000),
        (30.0, 1 / 10_000, 8.0, 1, 1000),
        (30.0, 1 / 10_000, 8.0, 200, 1000),  # the optimum (97) is below the range: its low end
        (0.01, 0.5, 2.0, 1, 100),  # cheaper than one step: every step
        (5.0, 1e-7, 1.0, 1, 500),  # the optimum (10,000) is above the range: its high end
    ],
)
def test_tier_optimum_is_the_brute_force_minimum(cost_s: float, rate: float, step_s: float, low: int, high: int):
    got = tier_optimum(cost_s, rate, step_s, low, high)
    brute = min(range(low, high + 1), key=lambda k: tier_waste(cost_s, rate, step_s, k))
    assert tier_waste(cost_s, rate, step_s, got) == pytest.approx(tier_waste(cost_s, rate, step_s, brute), rel=1e-12)
    assert low <= got <= high


def test_tier_optimum_is_young():
    # √(2 C M) with C = 18 s, M = 10,000 s: 600 s, i.e. 60 steps of 10 s.
    assert tier_optimum(18.0, 1 / 10_000, 10.0, 1, 10_000) == 60
    assert tier_optimum(18.0, 0.0, 10.0, 1, 777) == 777  # no failures: as rarely as allowed


def _inputs(**rates: float) -> CadenceInputs:
    return CadenceInputs(
        step_s=2.0,
        memory=TierCost(cost_s=0.4, restore_s=1.0),
        persist=TierCost(cost_s=12.0, restore_s=60.0),
        rates=rates,
        downtime_s={"process": 30.0, "node": 120.0, "job": 600.0},
    )


@pytest.mark.parametrize(
    "rates",
    [
        {"process": 1 / 3600, "node": 1 / 7200, "job": 1 / 86400},
        {"process": 1 / 600, "node": 0.0, "job": 1 / 3600},
        {"process": 0.0, "node": 0.0, "job": 1 / 20_000},
        {"process": 1 / 100, "node": 1 / 100, "job": 1 / 100},
    ],
)
def test_joint_optimum_is_the_brute_force_minimum(rates: dict[str, float]):
    inputs, bounds = _inputs(**rates), Bounds(memory=(1, 300), persist=(1, 600))
    got = optimize(inputs, bounds)
    brute = min(
        (waste(inputs, {"memory": m, "persist": p}), m, p) for m, p in itertools.product(range(1, 301), range(1, 601))
    )
    assert waste(inputs, got) == pytest.approx(brute[0], rel=1e-9)


def test_ram_tier_off_puts_every_class_on_storage():
    inputs = CadenceInputs(step_s=1.0, persist=TierCost(8.0, 20.0), rates={"process": 1e-3, "node": 1e-3, "job": 0})
    got = optimize(inputs, Bounds())
    assert set(got) == {"persist"}
    assert got["persist"] == tier_optimum(8.0, 2e-3, 1.0, 1, 1_000_000) == round(math.sqrt(2 * 8.0 / 2e-3))


def test_more_process_failures_shorten_the_ram_interval_not_the_durable_one():
    calm = optimize(_inputs(process=1 / 36_000, node=1 / 72_000, job=1 / 86_400), Bounds())
    flaky = optimize(_inputs(process=1 / 360, node=1 / 72_000, job=1 / 86_400), Bounds())
    assert flaky["memory"] < calm["memory"]
    assert flaky["persist"] == calm["persist"]


def test_costlier_saves_lengthen_the_interval():
    rates = {"process": 0.0, "node": 0.0, "job": 1 / 20_000}
    cheap = CadenceInputs(step_s=1.0, persist=TierCost(2.0, 5.0), rates=rates)
    dear = CadenceInputs(step_s=1.0, persist=TierCost(50.0, 5.0), rates=rates)
    assert optimize(dear, Bounds())["persist"] == pytest.approx(5 * optimize(cheap, Bounds())["persist"], abs=2)  # √25


def test_max_loss_wins_over_the_estimate_and_the_range():
    inputs = CadenceInputs(step_s=4.0, persist=TierCost(60.0, 5.0), rates={"job": 1e-7})
    assert optimize(inputs, Bounds())["persist"] > 1000
    assert optimize(inputs, Bounds(max_loss_s=400.0))["persist"] == 100
    # Even over the range's minimum: at most 10 steps (40 s) of work may be lost.
    assert optimize(inputs, Bounds(persist=(50, 500), max_loss_s=40.0))["persist"] == 10


def test_estimate_starts_at_the_prior_and_follows_the_evidence():
    node_mtbf, nodes = 1_000_000.0, 10
    prior = prior_rates(node_mtbf, nodes)
    assert mtbf_s(prior) == pytest.approx(100_000.0)  # a job of 10 nodes: a tenth of one node's
    assert estimate_rates(FailureHistory(), node_mtbf, nodes) == pytest.approx(prior)
    quiet = estimate_rates(FailureHistory(exposure_s=1_000_000.0), node_mtbf, nodes)
    assert all(quiet[c] < prior[c] for c in prior)  # failure-free time lowers every rate
    one = estimate_rates(FailureHistory(exposure_s=3600.0, counts={"process": 1}), node_mtbf, nodes)
    three = estimate_rates(FailureHistory(exposure_s=3600.0, counts={"process": 3}), node_mtbf, nodes)
    assert prior["process"] < one["process"] < three["process"]
    assert three["node"] == one["node"]  # only the class that failed moves
    # A small job's prior (months) gives way within hours to a node that fails every 20 minutes.
    small = estimate_rates(FailureHistory(exposure_s=4 * 3600.0, counts={"node": 12}), 2.28e7, 1)
    assert mtbf_s(small) < 3 * 3600
    # Much evidence: close to the observed rate (1,000 in 10^6 s), whatever the prior said.
    many = estimate_rates(FailureHistory(exposure_s=1e6, counts={"process": 1000}), node_mtbf, nodes)
    assert many["process"] == pytest.approx(1e-3, rel=0.05)


def test_recent_history_forgets_a_burst_that_is_over():
    day = 86400.0
    burst = [(day + 60.0 * i, "node") for i in range(10)]
    during = estimate_rates(recent_history(burst, 0.0, day + 600.0), 2.28e7, 16)
    after = estimate_rates(recent_history(burst, 0.0, 5 * day), 2.28e7, 16)
    assert after["node"] < during["node"] / 5
    # Nothing forgotten within a moment: the counts are the failures themselves.
    assert recent_history(burst, 0.0, day + 540.0).counts["node"] == pytest.approx(10, rel=1e-2)
