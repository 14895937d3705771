"""The online cadence: costs measured per tier, proposals that follow failures and costs, the
durable interval as the mean vote, max_loss_s, and every rank on the same intervals."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.runfiles import append_jsonl, events_path
from resilient.trainer.cadence import Cadence, CostMeter
from resilient.trainer.config import load_config
from tests.dist import run_world

pytestmark = pytest.mark.timeout(60)


def _config(run_dir: Path, *overrides: str):
    return load_config(
        None,
        [
            f"run.dir='{run_dir}'",
            "checkpoint.cadence='adaptive'",
            "checkpoint.memory_every=10",
            "checkpoint.persist_every=100",
            "checkpoint.mtbf_prior_s=36000",
            *overrides,
        ],
    )


def _measured(cadence: Cadence, *, step_s: float = 1.0, memory_s: float = 0.05, persist_s: float = 2.0) -> Cadence:
    for i in range(40):
        blocked = {"memory": memory_s} if i % 4 == 0 else {}
        if i % 10 == 5:
            blocked["persist"] = persist_s
        cadence.observe(step_s + sum(blocked.values()), blocked)
    return cadence


def _startups(run_dir: Path, causes: list[str], now: float) -> None:
    for i, cause in enumerate(causes):
        t = now - 3600 + 60 * i
        record = {"event": "startup", "group": 0, "t": t, "total_s": 5.0, "cause": cause}
        append_jsonl(events_path(str(run_dir)), record)


def test_cost_meter_counts_blocked_time_and_the_slower_next_step():
    meter = CostMeter()
    for i in range(30):
        if i % 3 == 0:
            meter.observe(1.0 + 0.2, {"memory": 0.2})
        elif i % 3 == 1:
            meter.observe(1.3, {})  # the step after a snapshot: 0.3 s slower than a clean one
        else:
            meter.observe(1.0, {})
    assert meter.step_s() == pytest.approx(1.0)
    assert meter.cost_s("memory") == pytest.approx(0.5)
    assert meter.cost_s("persist") is None  # never measured: its interval stays
    few = CostMeter()
    few.observe(1.2, {"memory": 0.2})
    few.observe(5.0, {})  # one slow step after the first snapshot: too little to call a slowdown
    few.observe(1.2, {"memory": 0.2})
    assert few.cost_s("memory") == pytest.approx(0.2)


def test_decisions_wait_for_a_measured_checkpoint_after_each_start(tmp_path: Path):
    cadence = Cadence(_config(tmp_path), group=0, nodes=2, buddies=True)
    cadence.started(8)
    assert not cadence.decides_at(10) and not cadence.decides_at(18)  # too early; nothing measured
    cadence.observe(1.1, {"memory": 0.1})
    assert not cadence.decides_at(17) and cadence.decides_at(18) and not cadence.decides_at(19)
    assert cadence.decides_at(28)


def test_fixed_cadence_never_moves(tmp_path: Path):
    cadence = _measured(Cadence(load_config(None, [f"run.dir='{tmp_path}'"]), group=0, nodes=2, buddies=True))
    assert not cadence.decides_at(10)
    assert cadence.voted(7.0, 1.0) == [] and (cadence.memory_every, cadence.persist_every) == (0, 50)


def test_failures_shorten_the_ram_interval(tmp_path: Path):
    now = 1e9
    calm = _measured(Cadence(_config(tmp_path / "calm"), group=0, nodes=2, buddies=True))
    _startups(tmp_path / "calm", ["first"], now)
    flaky = _measured(Cadence(_config(tmp_path / "flaky"), group=0, nodes=2, buddies=True))
    _startups(tmp_path / "flaky", ["first", *["rank_failed"] * 8, "node_lost"], now)
    calm_every = calm.propose(now)["every"]
    flaky_proposal = flaky.propose(now)
    assert flaky_proposal["every"]["memory"] < calm_every["memory"]
    detail = flaky_proposal["detail"]["memory"]
    assert detail["mtbf_s"] < 3000 and detail["cost_s"] == pytest.approx(0.05, rel=0.05)
    assert detail["waste"] <= detail["waste_fixed"]
    # Taking it changes the RAM interval at once and says so; the durable one becomes the vote.
    (event,) = flaky.take(flaky_proposal)
    assert event["tier"] == "memory" and event["previous"] == 10 and event["every_steps"] == flaky.memory_every
    assert flaky.vote == flaky_proposal["every"]["persist"]


def test_dearer_saves_lengthen_the_durable_interval(tmp_path: Path):
    now = 1e9
    _startups(tmp_path, ["first"], now)
    cheap = _measured(Cadence(_config(tmp_path), group=0, nodes=4, buddies=True), persist_s=0.5)
    dear = _measured(Cadence(_config(tmp_path), group=0, nodes=4, buddies=True), persist_s=8.0)
    assert dear.propose(now)["every"]["persist"] > cheap.propose(now)["every"]["persist"]


def test_max_loss_s_wins_and_the_vote_is_the_mean(tmp_path: Path):
    now = 1e9
    _startups(tmp_path, ["first"], now)
    cadence = _measured(Cadence(_config(tmp_path, "checkpoint.max_loss_s=30"), group=0, nodes=1, buddies=False))
    proposal = cadence.propose(now)
    assert proposal["every"]["persist"] <= 30  # steps of ~1 s: at most 30 s of work lost
    cadence.take(proposal)
    (event,) = cadence.voted(3 * 20.0 + 26.0, 4.0)  # four ranks or groups voted 20, 20, 20 and 26
    assert cadence.persist_every == 22 and event["tier"] == "persist" and event["previous"] == 100


def _agree_worker(rank: int, world: int, run_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from resilient import dist as rdist

    cadence = Cadence(_config(Path(run_dir)), group=0, nodes=2, buddies=True)
    # Each rank measured something else (rank 1's saves look 20x dearer): rank 0's proposal wins.
    _measured(cadence, persist_s=1.0 + 19.0 * rank, memory_s=0.05 * (1 + rank))
    proposal = rdist.agree(lambda: cadence.propose(1e9), src=0, what="checkpoint cadence")
    events = cadence.take(proposal)
    votes = torch.tensor([cadence.vote, 1.0], dtype=torch.float64)
    dist.all_reduce(votes)
    events += cadence.voted(*votes.tolist())
    return {"every": cadence.every, "events": events}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_use_the_same_intervals(tmp_path: Path):
    _startups(tmp_path, ["first", "rank_failed", "rank_failed", "rank_failed"], 1e9)
    results = run_world(_agree_worker, 2, str(tmp_path), timeout_s=90)
    assert results[0] == results[1]
    assert results[0]["every"] != {"memory": 10, "persist": 100}  # it did move


def test_a_restart_goes_on_with_the_intervals_and_costs_the_run_had_reached(tmp_path: Path):
    now = 1e9
    _startups(tmp_path, ["first", "rank_failed"], now)
    for tier, every, cost in (("memory", 3, 0.05), ("persist", 40, 2.0)):
        record = {"event": "cadence", "group": 0, "t": now - 100, "tier": tier, "every_steps": every, "cost_s": cost}
        append_jsonl(events_path(str(tmp_path)), record)
    cadence = Cadence(_config(tmp_path), group=0, nodes=2, buddies=True)
    proposal = cadence.resumed()
    assert proposal["every"] == {"memory": 3, "persist": 40} and proposal["detail"]["memory"]["resumed"]
    (event,) = cadence.take(proposal)
    assert (event["every_steps"], event["previous"], cadence.vote) == (3, 10, 40.0)
    # No checkpoint measured yet in this incarnation: the last one's costs stand in.
    for _ in range(5):
        cadence.observe(1.0, {})
    assert cadence.propose(now)["detail"]["memory"]["cost_s"] == pytest.approx(0.05)


def test_the_ram_interval_is_decided_before_the_first_save_is_measured(tmp_path: Path):
    now = 1e9
    _startups(tmp_path, ["first", *["rank_failed"] * 6], now)
    cadence = Cadence(_config(tmp_path, "checkpoint.max_loss_s=50"), group=0, nodes=2, buddies=True)
    for i in range(12):
        blocked = {"memory": 0.05} if i % 4 == 0 else {}
        cadence.observe(1.0 + sum(blocked.values()), blocked)
    every = cadence.propose(now)["every"]
    assert every["memory"] != cadence.memory_every  # decided (18 steps: Young's √(2 C M) here)
    assert every["persist"] == 50  # no save measured: pinned, except that max_loss_s still caps it


def test_a_failing_proposal_keeps_the_intervals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The proposal goes to every rank through dist.agree: an exception in it would end training on
    every rank, for advice. It keeps the current intervals instead."""
    cadence = _measured(Cadence(_config(tmp_path), group=0, nodes=2, buddies=True))

    def broken(now):
        raise ValueError("math domain error")

    monkeypatch.setattr(cadence, "inputs", broken)
    assert cadence.propose(1e9) == {"every": {"memory": 10, "persist": 100}, "detail": {}}
