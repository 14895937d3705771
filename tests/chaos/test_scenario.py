"""Scenario files: what parses, what is refused, and how random faults are drawn."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from resilient.chaos.scenario import FAULT_KINDS, list_scenarios, load_scenario, parse_scenario
from resilient.errors import ConfigError

pytestmark = [pytest.mark.timeout(30)]

BASE = {
    "job": {
        "config": "configs/tiny.toml",
        "replica_groups": 2,
        "nproc_per_group": 2,
        "ranks_per_node": 1,
        "steps": 20,
        "set": ["parallel.tp=1"],
    },
    "fault": [{"kind": "kill_rank", "at_step": 5, "group": 1, "rank": 0}],
    "check": {"max_steps_lost_per_fault": 2},
}


def _with(**changes: object) -> dict:
    data = copy.deepcopy(BASE)
    for path, value in changes.items():
        table, key = path.split("__")
        target = data[table][0] if table == "fault" else data[table]
        if value is None:
            target.pop(key)
        else:
            target[key] = value
    return data


def test_valid_scenario_parses_with_defaults() -> None:
    scenario = parse_scenario(_with())
    assert scenario.job.replica_groups == 2 and scenario.job.steps == 20
    assert Path(scenario.job.config).is_absolute() and Path(scenario.job.config).name == "tiny.toml"
    (fault,) = scenario.faults
    assert (fault.kind, fault.at_step, fault.group, fault.rank) == ("kill_rank", 5, 1, 0)
    assert scenario.check.max_steps_lost_per_fault == 2 and scenario.check.twin is True
    assert scenario.job.hold_step == 18


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"fault__kind": "explode"}, "fault[0].kind='explode' is not a fault kind; allowed: ["),
        ({"fault__group": None}, "fault[0] (kill_rank): missing key(s) ['group']"),
        ({"fault__rank": 2}, "fault[0] (kill_rank).rank=2 must be an integer [0, 1]"),
        ({"fault__at_step": 20}, "fault[0] (kill_rank).at_step=20 must be an integer [1, 19]"),
        ({"fault__rate": 0.5}, "unknown key(s) ['rate']; kill_rank takes ['expect_restore_source', 'group', 'rank']"),
        (
            {"fault__expect_restore_source": "disk"},
            "fault[0] (kill_rank).expect_restore_source='disk' must be one of ['own', 'buddy', 'persistent', 'peer', "
            "'fresh']",
        ),
        ({"fault__at_time_s": 3.0}, "give exactly one of at_step, at_time_s or random = true"),
        ({"fault__at_step": None}, "give exactly one of at_step, at_time_s or random = true (got none)"),
        ({"job__storage": "nfs"}, "job.storage='nfs' must be one of ['local', 's3']"),
        ({"job__ranks_per_node": 3}, "job.ranks_per_node=3 must be an integer [0, 2]"),
        ({"job__replicas": 2}, "unknown key(s) ['replicas'] in [job]"),
        ({"job__config": "configs/nope.toml"}, "job.config='configs/nope.toml' not found"),
        ({"job__set": ["run.dir=/tmp/x"]}, "the harness sets run.dir, run.steps and checkpoint.url"),
        ({"check__max_steps_lost_per_fault": -1}, "check.max_steps_lost_per_fault=-1 must be an integer >= 0"),
        ({"check__twin_tol": 1.0}, "unknown key(s) ['twin_tol'] in [check]"),
    ],
)
def test_bad_scenarios_name_the_key_and_what_is_allowed(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_scenario(_with(**changes))
    assert message in str(err.value)


def test_fault_kinds_that_need_other_settings_are_refused() -> None:
    s3 = _with()
    s3["fault"] = [{"kind": "s3_errors", "at_step": 3, "rate": 0.5}]
    with pytest.raises(ConfigError, match=r"s3_errors needs job.storage = 's3' \(got 'local'\)"):
        parse_scenario(s3)
    node = _with(job__ranks_per_node=None)
    node["fault"] = [{"kind": "kill_node", "at_step": 3, "group": 0, "node": 0}]
    with pytest.raises(ConfigError, match="kill_node needs job.ranks_per_node"):
        parse_scenario(node)
    rate = _with(job__storage="s3")
    rate["fault"] = [{"kind": "s3_errors", "at_step": 3, "rate": 1.5}]
    with pytest.raises(ConfigError, match=r"rate=1.5 is out of range: allowed \[0.0, 1.0\]"):
        parse_scenario(rate)


def test_s3_ambiguous_takes_a_key_glob_and_a_drop_limit() -> None:
    data = _with(job__storage="s3")
    data["fault"] = [{"kind": "s3_ambiguous", "at_step": 3, "keys": "*/manifest.json", "drops": 2}]
    (fault,) = parse_scenario(data).faults
    assert (fault.kind, fault.keys, fault.drops, fault.seconds, fault.rate) == (
        "s3_ambiguous",
        "*/manifest.json",
        2,
        10.0,
        1.0,
    )
    assert fault.describe() == {
        "kind": "s3_ambiguous",
        "at_step": 3,
        "drawn": False,
        "seconds": 10.0,
        "rate": 1.0,
        "keys": "*/manifest.json",
        "drops": 2,
    }
    data["fault"] = [{"kind": "s3_ambiguous", "at_step": 3}]
    (fault,) = parse_scenario(data).faults
    assert (fault.keys, fault.drops) == ("*", 1), "by default: any key, one lost answer"
    for bad, message in [
        ({"keys": ""}, "fault[0] (s3_ambiguous).keys='' must be a non-empty glob"),
        ({"keys": 3}, "fault[0] (s3_ambiguous).keys=3 must be a non-empty glob"),
        ({"drops": -1}, "fault[0] (s3_ambiguous).drops=-1 must be an integer [0, 10000]"),
        ({"delay_s": 1.0}, "unknown key(s) ['delay_s']; s3_ambiguous takes ['drops', 'keys', 'rate', 'seconds']"),
    ]:
        data["fault"] = [{"kind": "s3_ambiguous", "at_step": 3, **bad}]
        with pytest.raises(ConfigError) as err:
            parse_scenario(data)
        assert message in str(err.value)
    local = _with()
    local["fault"] = [{"kind": "s3_ambiguous", "at_step": 3, "keys": "latest"}]
    with pytest.raises(ConfigError, match=r"s3_ambiguous needs job.storage = 's3' \(got 'local'\)"):
        parse_scenario(local)


def test_s3_ambiguous_scenario_aims_at_manifests_latest_and_the_final_save() -> None:
    scenario = load_scenario("s3_ambiguous")
    assert scenario.job.storage == "s3"
    hits = [(f.kind, f.keys, f.drops, f.at_step) for f in scenario.faults]
    assert hits == [
        ("s3_ambiguous", "*/manifest.json", 1, 2),
        ("s3_ambiguous", "latest", 1, 10),
        ("s3_ambiguous", "*/manifest.json", 1, 14),
    ]
    # The last window opens before the final step's save: that commit is the one under test.
    assert scenario.faults[-1].at_step < scenario.job.steps


def test_random_faults_are_drawn_from_the_seed() -> None:
    data = _with()
    data["fault"] = [{"kind": "kill_rank", "random": True, "count": 4, "min_step": 3, "max_step": 15}]
    a, b, c = (parse_scenario(data, seed=s) for s in (7, 7, 8))
    steps = [f.at_step for f in a.faults]
    assert len(steps) == 4 and steps == sorted(set(steps)) and all(3 <= s <= 15 for s in steps)
    assert [(f.at_step, f.group, f.rank) for f in a.faults] == [(f.at_step, f.group, f.rank) for f in b.faults]
    assert [(f.at_step, f.group, f.rank) for f in a.faults] != [(f.at_step, f.group, f.rank) for f in c.faults]
    assert all(f.drawn and 0 <= f.group < 2 and 0 <= f.rank < 2 for f in a.faults)
    assert [f.index for f in a.faults] == [0, 1, 2, 3]
    data["fault"][0]["count"] = 20
    with pytest.raises(ConfigError, match=r"count=20 > the 13 steps in \[min_step=3, max_step=15\]"):
        parse_scenario(data)


def test_shipped_scenarios_parse() -> None:
    names = list_scenarios()
    assert "smoke" in names
    for name in names:
        scenario = load_scenario(name, seed=1)
        assert scenario.name == name and all(f.kind in FAULT_KINDS for f in scenario.faults)
    with pytest.raises(ConfigError, match="scenario 'nope' not found"):
        load_scenario("nope")
