"""A scenario run again with other overrides: the comparison's scenario, lost work, verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.chaos.compare import compare_scenario, lost_work, no_worse, shorter_ram
from resilient.chaos.scenario import load_scenario, parse_scenario
from resilient.errors import ConfigError
from resilient.runfiles import append_jsonl, group_file

pytestmark = pytest.mark.timeout(30)


def test_the_compare_run_has_the_same_faults_and_the_overrides_on_top():
    scenario = load_scenario("cadence_kills")
    other = compare_scenario(scenario)
    assert other.faults == scenario.faults and other.job.set[-1] == "checkpoint.cadence='fixed'"
    assert other.job.set[:-1] == scenario.job.set
    assert (other.check.compare_set, other.check.expect_shorter_ram, other.check.twin) == ([], False, False)


def test_bad_compare_keys_are_config_errors():
    with pytest.raises(ConfigError, match="check.compare_set"):
        parse_scenario({"job": {"config": "configs/tiny.toml"}, "check": {"compare_set": ["no equals sign"]}})
    with pytest.raises(ConfigError, match="check.expect_shorter_ram"):
        parse_scenario({"job": {"config": "configs/tiny.toml"}, "check": {"expect_shorter_ram": "yes"}})


def _metrics(run_dir: Path, rows: list[tuple[int, float, float]]) -> str:
    for step, step_s, stall in rows:
        append_jsonl(
            group_file(str(run_dir), "metrics.jsonl", 0), {"step": step, "step_time_s": step_s, "ckpt_stall_s": stall}
        )
    return str(run_dir)


def test_lost_work_is_recomputed_steps_plus_every_stall(tmp_path: Path):
    run = _metrics(tmp_path / "a", [(1, 1.0, 0.0), (2, 1.5, 0.5), (3, 1.0, 0.0), (2, 1.5, 0.5)])  # step 2 redone
    got = lost_work(run, [{"steps_lost": 2}, {"steps_lost": 1}])
    assert got == {"steps_lost": 3, "step_s": 1.0, "stall_s": 1.0, "lost_s": 4.0}
    other = _metrics(tmp_path / "b", [(1, 1.0, 0.0), (2, 1.0, 0.0), (3, 1.0, 0.0)])
    worse = no_worse({"faults": [{"steps_lost": 8}]}, {"passed": True, "faults": []}, other, run)
    better = no_worse({"faults": []}, {"passed": True, "faults": [{"steps_lost": 8}]}, other, run)
    assert not worse["ok"] and better["ok"] and "8 steps recomputed" in worse["reason"]


def test_shorter_ram_needs_a_shorter_interval_after_a_failure():
    first = {"event": "startup", "t": 1.0, "cause": "first"}
    failed = {"event": "startup", "t": 10.0, "cause": "rank_failed"}
    before = {"event": "cadence", "t": 5.0, "tier": "memory", "every_steps": 4}
    after = {"event": "cadence", "t": 12.0, "tier": "memory", "every_steps": 3}
    assert shorter_ram([first, failed, before, after], 8)["ok"]
    assert not shorter_ram([first, before, failed], 8)["ok"]  # only before any failure
    assert not shorter_ram([first, failed, {**after, "every_steps": 8}], 8)["ok"]
