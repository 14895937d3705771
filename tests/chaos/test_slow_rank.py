"""slow_rank: the scenario takes it (and refuses bad values in one line), the harness arms its span
before the span begins, and the step hook slows the compute of the named rank only, over the span only.
No job runs: the hook is driven with a stand-in trainer, as the loop would drive it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from resilient.chaos.hooks import CHAOS_DIR_ENV, chaos_hook, slow_path
from resilient.chaos.inject import FaultRecord, InjectContext, advance
from resilient.chaos.scenario import NO_DOWNTIME_KINDS, PROCESS_KINDS, load_scenario, parse_scenario
from resilient.errors import ConfigError
from resilient.runfiles import HOOK_EVENTS_FILE, read_jsonl

DELAY_S = 0.08

BASE = {
    "job": {"config": "configs/tiny.toml", "replica_groups": 2, "nproc_per_group": 2, "steps": 20},
    "fault": [{"kind": "slow_rank", "at_step": 5, "steps": 4, "group": 1, "rank": 1, "delay_s": 0.25}],
}


def _fault(**changes: object) -> dict:
    data = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            data["fault"][0].pop(key)
        else:
            data["fault"][0][key] = value
    return data


@pytest.mark.timeout(30)
def test_slow_rank_parses_with_its_span() -> None:
    fault = parse_scenario(_fault()).faults[0]
    assert (fault.kind, fault.group, fault.rank, fault.at_step, fault.steps, fault.delay_s) == (
        "slow_rank",
        1,
        1,
        5,
        4,
        0.25,
    )
    assert fault.describe() == {
        "kind": "slow_rank",
        "at_step": 5,
        "drawn": False,
        "group": 1,
        "rank": 1,
        "steps": 4,
        "delay_s": 0.25,
    }
    defaults = parse_scenario(_fault(steps=None, delay_s=None)).faults[0]
    assert (defaults.steps, defaults.duty) == (10, 0.4)  # held from outside unless delay_s is given
    assert defaults.describe()["duty"] == 0.4 and "delay_s" not in defaults.describe()
    throttled = parse_scenario(_fault(delay_s=None, duty=0.3)).faults[0]
    assert (throttled.duty, throttled.steps) == (0.3, 4)
    for duty in (0.01, 0.95, True, "half"):
        with pytest.raises(
            ConfigError, match=r"fault\[0\] \(slow_rank\).duty=.* must be a share of the time in \[0.05, 0.9\]"
        ):
            parse_scenario(_fault(delay_s=None, duty=duty))
    assert "slow_rank" in NO_DOWNTIME_KINDS and "slow_rank" not in PROCESS_KINDS


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": 0}, r"fault\[0\] \(slow_rank\).steps=0 must be an integer \[1, 20\]"),
        ({"steps": 2.5}, r"fault\[0\] \(slow_rank\).steps=2.5 must be an integer"),
        ({"delay_s": 0}, r"fault\[0\] \(slow_rank\).delay_s=0 must be > 0 seconds"),
        ({"delay_s": -1}, r"fault\[0\] \(slow_rank\).delay_s=-1 is out of range: allowed \[0.0, 60.0\]"),
        ({"delay_s": "slow"}, r"fault\[0\] \(slow_rank\).delay_s='slow' must be a number"),
        ({"rank": 2}, r"fault\[0\] \(slow_rank\).rank=2 must be an integer \[0, 1\]"),
        ({"group": None}, r"fault\[0\] \(slow_rank\): missing key\(s\) \['group'\]"),
        ({"at_step": 18}, r"steps 18..21 \(at_step=18, steps=4\) run past job.steps=20"),
        (
            {"seconds": 3},
            r"unknown key\(s\) \['seconds'\]; slow_rank takes \['delay_s', 'duty', 'group', 'rank', 'steps'\]",
        ),
        ({"duty": 0.95}, r"fault\[0\] \(slow_rank\): give duty \(stopped from outside\) or delay_s"),
    ],
)
def test_bad_values_are_one_line_errors(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_scenario(_fault(**changes))
    assert "\n" not in str(info.value)


@pytest.mark.timeout(30)
def test_drawn_slow_rank_may_run_past_the_end() -> None:
    data = _fault(at_step=None, group=None, rank=None, random=True, steps=15)
    fault = parse_scenario(data, seed=3).faults[0]
    assert fault.drawn and 2 <= fault.at_step <= 17 and fault.group in (0, 1) and fault.rank in (0, 1)


@pytest.mark.timeout(30)
def test_shipped_straggler_scenario() -> None:
    scenario = load_scenario("straggler")
    [fault] = scenario.faults
    assert (fault.kind, fault.at_step, fault.steps, fault.duty) == ("slow_rank", 6, 20, 0.4)
    assert fault.at_step + fault.steps - 1 <= scenario.job.steps


def _ctx(tmp_path: Path, job_step: int) -> InjectContext:
    job = SimpleNamespace(chaos_dir=str(tmp_path / "chaos"), job=SimpleNamespace(replica_groups=2, nproc_per_group=2))
    return InjectContext(job=job, config=None, proxy=None, job_step=job_step)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_harness_arms_the_span_before_it_begins(tmp_path: Path) -> None:
    spec = parse_scenario(_fault()).faults[0]
    record = FaultRecord(spec=spec)
    ctx = _ctx(tmp_path, job_step=1)
    advance(record, ctx, t_first_commit=time.time())
    assert record.state == "pending"  # not due yet, but already armed: the hook must see step 5 coming
    path = slow_path(ctx.job.chaos_dir, 1)
    expected = [{"fault": 0, "rank": 1, "first_step": 5, "last_step": 8, "delay_s": 0.25}]
    assert json.loads(Path(path).read_text()) == expected
    ctx.job_step = 5
    advance(record, ctx, t_first_commit=time.time())
    assert record.state == "done" and record.at_step == 5 and record.extra["slow_steps"] == [5, 8]
    assert json.loads(Path(path).read_text()) == expected  # not armed twice
    assert not os.path.exists(slow_path(ctx.job.chaos_dir, 0))


@pytest.mark.timeout(30)
def test_a_timed_slow_rank_starts_at_the_next_step(tmp_path: Path) -> None:
    data = _fault(at_step=None, at_time_s=1.0)
    record = FaultRecord(spec=parse_scenario(data).faults[0])
    ctx = _ctx(tmp_path, job_step=7)
    advance(record, ctx, t_first_commit=time.time())
    assert record.state == "pending" and not os.path.exists(slow_path(ctx.job.chaos_dir, 1))
    advance(record, ctx, t_first_commit=time.time() - 2.0)
    assert record.state == "done" and record.extra["slow_steps"] == [8, 11]


def _run_steps(tmp_path: Path, monkeypatch, *, group: int, rank: int, steps: int) -> list[float]:
    """Compute times of steps 1..steps, with the chaos hook after each, as trainer/loop.py runs them."""
    monkeypatch.setenv(CHAOS_DIR_ENV, str(tmp_path / "chaos"))
    monkeypatch.setenv("RANK", str(rank))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    trainer = SimpleNamespace(group=group, step=0, parts=SimpleNamespace(model=model), before_compute=[], pp_group=None)
    trainer.parts.model(torch.ones(2, 4))  # warm-up: the first call of an op is slow (dispatch, allocation)
    hook = chaos_hook(trainer)
    assert hook is not None
    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        for before in trainer.before_compute:  # as Trainer.train_step: before the first collective
            before(step)
        trainer.parts.model(torch.ones(2, 4))
        times.append(time.perf_counter() - start)
        trainer.step = step
        hook(step, trainer)
    return times


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("group", "rank", "slowed"), [(1, 1, {3, 4, 5}), (1, 0, set()), (0, 1, set())])
def test_hook_slows_the_named_rank_over_the_span_only(tmp_path: Path, monkeypatch, group, rank, slowed) -> None:
    path = slow_path(str(tmp_path / "chaos"), 1)
    os.makedirs(os.path.dirname(path))
    Path(path).write_text(json.dumps([{"fault": 2, "rank": 1, "first_step": 3, "last_step": 5, "delay_s": DELAY_S}]))
    times = _run_steps(tmp_path, monkeypatch, group=group, rank=rank, steps=7)
    assert {step for step, t in enumerate(times, start=1) if t >= DELAY_S} == slowed
    assert all(t < DELAY_S / 2 for step, t in enumerate(times, start=1) if step not in slowed)
    events = [e for e in read_jsonl(str(tmp_path / "chaos" / HOOK_EVENTS_FILE)) if e["event"] == "slowed"]
    if slowed:
        assert [(e["group"], e["rank"], e["step"], e["delay_s"], e["fault"]) for e in events] == [(1, 1, 3, DELAY_S, 2)]
    else:
        assert events == []


@pytest.mark.timeout(60)
def test_a_span_armed_mid_run_is_picked_up_after_the_next_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CHAOS_DIR_ENV, str(tmp_path / "chaos"))
    monkeypatch.setenv("RANK", "0")
    trainer = SimpleNamespace(
        group=0, step=0, parts=SimpleNamespace(model=torch.nn.Linear(4, 4)), before_compute=[], pp_group=None
    )
    hook = chaos_hook(trainer)
    assert hook is not None and hook.slow_spans == []
    path = slow_path(str(tmp_path / "chaos"), 0)
    os.makedirs(os.path.dirname(path))
    Path(path).write_text(json.dumps([{"fault": 0, "rank": 0, "first_step": 2, "last_step": 2, "delay_s": DELAY_S}]))
    trainer.step = 1
    hook(1, trainer)
    start = time.perf_counter()
    for before in trainer.before_compute:  # step 2's compute
        before(2)
    assert time.perf_counter() - start >= DELAY_S


@pytest.mark.timeout(60)
def test_duty_mode_holds_the_rank_stopped_from_outside_over_its_span(tmp_path: Path) -> None:
    from resilient.runfiles import pid_path, write_pid_file

    child = (
        "import sys, time; sys.path.insert(0, '.');"
        "from resilient.trainer.observing.straggler import StallClock;"
        "c = StallClock().start(); print('ready', flush=True); sys.stdin.readline(); print(c.held_s(), flush=True)"
    )
    # "resilient.trainer" in its command line: the harness takes it for a rank.
    proc = subprocess.Popen(
        [sys.executable, "-c", child, "resilient.trainer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        run_dir = str(tmp_path / "run")
        write_pid_file(pid_path(run_dir, 1, 1), pid=proc.pid)
        spec = parse_scenario(_fault(delay_s=None, duty=0.4)).faults[0]
        record = FaultRecord(spec=spec)
        ctx = _ctx(tmp_path, job_step=2)
        ctx.job.run_dir = run_dir
        advance(record, ctx, t_first_commit=time.time())
        assert record.state == "pending" and record._throttle is None  # step 4 (the one before 5) not yet committed
        ctx.job_step = 4
        advance(record, ctx, t_first_commit=time.time())
        assert record._throttle is not None and record.extra["slow_steps"] == [5, 8]
        ctx.job_step = 5
        advance(record, ctx, t_first_commit=time.time())
        assert record.state == "injected" and not os.path.exists(slow_path(ctx.job.chaos_dir, 1))
        time.sleep(1.0)
        ctx.job_step = 8
        advance(record, ctx, t_first_commit=time.time())
        assert record.state == "done" and record._throttle is None
        assert 0.25 <= record.extra["duty_measured"] <= 0.55 and record.extra["stopped_s"] > 0.2
        out, _ = proc.communicate("\n", timeout=20)  # continued: it answers
        assert float(out) >= 0.6 * record.extra["stopped_s"]
    finally:
        proc.kill()
