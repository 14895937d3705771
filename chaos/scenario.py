"""A chaos scenario: the job to run, the faults to inject into it, and what to check afterwards.

    [job]
    config = "configs/tiny.toml"     # recipe; relative to the cwd, the scenario file, or the repo
    replica_groups = 2
    nproc_per_group = 2
    ranks_per_node = 1               # simulated nodes inside a group (RAM tier, kill_node)
    steps = 40
    storage = "local"                # or "s3": the harness starts a loopback S3 endpoint + fault proxy
    set = ["checkpoint.persist_every=10", "checkpoint.memory_every=2"]

    [[fault]]
    kind = "kill_rank"
    at_step = 12                     # or at_time_s (after the first committed step), or random = true
    group = 1
    rank = 0

    [check]
    twin = true
    max_steps_lost_per_fault = 2

Parsed into validated dataclasses; every mistake is one ConfigError naming the key, the fault and
what is allowed. ``random = true`` faults are drawn here, from ``--seed`` (or ``[job] seed``), so a
scenario and a seed name one exact sequence of faults.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from resilient.errors import ConfigError
from resilient.recovery.restore import SOURCES

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIOS_DIR = Path(__file__).resolve().parent / "scenarios"

"""The ``source`` of the job's ``restore`` events, what ``expect_restore_source`` may name."""

FAULT_KINDS: dict[str, tuple[set[str], set[str]]] = {
    # kind: (required target keys, optional keys); timing keys are common to all kinds
    "kill_rank": ({"group", "rank"}, {"expect_restore_source"}),
    "kill_node": ({"group", "node"}, {"expect_restore_source"}),
    # A node gone across a RAM restore (its newest snapshot not yet copied), back once that step is
    # retrained, with the snapshots it held (``chaos.away``).
    "node_away": ({"group", "node"}, {"expect_restore_source"}),
    "kill_group": ({"group"}, {"expect_restore_source"}),
    "stop_rank": ({"group", "rank"}, {"seconds"}),
    "kill_during_persist": ({"rank"}, {"seconds", "expect_restore_source"}),
    "kill_during_heal": ({"group", "rank"}, {"seconds", "expect_restore_source"}),
    "corrupt_chunk": (set(), {"target"}),
    "s3_errors": (set(), {"seconds", "rate"}),
    "s3_resets": (set(), {"seconds", "rate"}),
    "s3_latency": (set(), {"seconds", "delay_s"}),
    # Writes that land but whose answers are lost: the client's retry meets its own write.
    "s3_ambiguous": (set(), {"seconds", "rate", "keys", "drops"}),
    "kill_lighthouse": (set(), set()),
    # Test-only: perturbs one parameter of a group, so replicas_identical and twin_match must fail.
    "corrupt_replica": ({"group"}, set()),
    # A straggler for `steps` steps from at_step on: stopped from outside `duty` of the time
    # (SIGSTOP/SIGCONT), or, with delay_s instead, sleeping delay_s at the start of each step's compute.
    "slow_rank": ({"group", "rank"}, {"steps", "duty", "delay_s"}),
}
"""Every fault kind, with the keys it needs and the keys it may take."""

NO_DOWNTIME_KINDS = {
    "corrupt_chunk",
    "corrupt_replica",
    "s3_errors",
    "s3_resets",
    "s3_latency",
    "s3_ambiguous",
    "slow_rank",
}
"""Fault kinds that stop no process: storage trouble, flipped bytes and a slow rank (no detection or
recovery time of their own; a restart or a failed save after one of them alone is a bug)."""
PROCESS_KINDS = set(FAULT_KINDS) - NO_DOWNTIME_KINDS
"""Fault kinds that kill or stop a process: a restart or a failed save may follow from them."""

DEFAULT_DUTY = 0.4
"""slow_rank without duty or delay_s: stopped 40% of the time."""
_TIMING_KEYS = {"kind", "at_step", "at_time_s", "random", "count", "min_step", "max_step"}
_GROUP_DOWN_KINDS = {"kill_rank", "kill_node", "node_away", "kill_group", "kill_during_persist", "kill_during_heal"}
_DEFAULT_SECONDS = {
    "stop_rank": 10.0,
    "kill_during_persist": 60.0,
    "kill_during_heal": 60.0,
    "s3_errors": 5.0,
    "s3_resets": 5.0,
    "s3_latency": 5.0,
    "s3_ambiguous": 10.0,
}


def _int(where: str, value: object, low: int, high: int | None = None) -> int:
    allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ConfigError(f"{where}={value!r} must be an integer {allowed}")
    return value


def _number(where: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}={value!r} must be a number in [{low}, {high}]")
    if not low <= value <= high:
        raise ConfigError(f"{where}={value} is out of range: allowed [{low}, {high}]")
    return float(value)


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """``[job]``: what ``resilient-train --replica-groups`` runs."""

    config: str
    """The recipe, resolved to an absolute path."""
    replica_groups: int = 2
    nproc_per_group: int = 1
    ranks_per_node: int = 0
    """Simulated nodes: ``recovery.ranks_per_node`` (0: leave the recipe's)."""
    steps: int = 16
    storage: str = "local"
    """'local': checkpoints under the run directory; 's3': a loopback moto endpoint behind a fault proxy."""
    set: list[str] = field(default_factory=list)
    """``--set key=value`` overrides of the recipe (the harness adds run.dir, run.steps and its hook)."""
    max_restarts: int = 3
    """torchrun restarts per group (every kill of a group uses one)."""
    step_sleep_s: float = 0.2
    """Pacing: every rank sleeps this long after each committed step, so faults land mid-run on a
    fast CPU job (the twin runs unpaced: sleeping changes no numerics)."""
    hold_at_step: int = -1
    """While a killed group has not rejoined, the live groups wait at this step, so the run cannot end
    before the restarted group heals (-1: steps - 2; 0: never hold). Held time is reported apart."""
    timeout_s: float = 600.0
    """The whole faulted run must end within this; past it the harness stops the job (finished fails)."""
    seed: int = 0
    """Seed of the random faults unless ``--seed`` is given."""

    def __post_init__(self) -> None:
        _int("job.replica_groups", self.replica_groups, 1, 64)
        _int("job.nproc_per_group", self.nproc_per_group, 1, 64)
        _int("job.ranks_per_node", self.ranks_per_node, 0, self.nproc_per_group)
        if self.ranks_per_node and self.nproc_per_group % self.ranks_per_node:
            raise ConfigError(
                f"job.ranks_per_node={self.ranks_per_node} must divide job.nproc_per_group={self.nproc_per_group}"
            )
        _int("job.steps", self.steps, 2)
        if self.storage not in ("local", "s3"):
            raise ConfigError(f"job.storage={self.storage!r} must be one of ['local', 's3']")
        if not isinstance(self.set, list) or not all(isinstance(s, str) and "=" in s for s in self.set):
            raise ConfigError(f"job.set={self.set!r} must be a list of 'key=value' strings")
        for item in self.set:
            if item.split("=", 1)[0].strip() in ("run.dir", "run.steps", "checkpoint.url"):
                raise ConfigError(
                    f"job.set entry {item!r}: the harness sets run.dir, run.steps and checkpoint.url "
                    "(use job.steps and job.storage)"
                )
        _int("job.max_restarts", self.max_restarts, 0, 100)
        _number("job.step_sleep_s", self.step_sleep_s, 0.0, 60.0)
        _int("job.hold_at_step", self.hold_at_step, -1, self.steps)
        _number("job.timeout_s", self.timeout_s, 10.0, 86400.0)
        _int("job.seed", self.seed, 0, 2**31 - 1)

    @property
    def hold_step(self) -> int:
        return self.steps - 2 if self.hold_at_step < 0 else self.hold_at_step


@dataclass(kw_only=True, slots=True)
class FaultSpec:
    """One ``[[fault]]``, with random choices already drawn."""

    kind: str
    index: int = 0
    """Position in the scenario (after expanding ``count``)."""
    at_step: int | None = None
    at_time_s: float | None = None
    group: int = 0
    rank: int = 0
    node: int = 0
    seconds: float = 0.0
    rate: float = 1.0
    delay_s: float = 0.5
    """s3_latency: added to each request; slow_rank (when given instead of duty): slept at the start
    of each slowed step's compute, inside the rank's own code."""
    duty: float = 0.0
    """slow_rank: the share of the time the rank's process is held stopped from outside (a
    SIGSTOP/SIGCONT duty cycle, as a throttled host); 0 with delay_s."""
    steps: int = 10
    """slow_rank: how many consecutive steps, from at_step on, the rank is slow (cut at the run's end)."""
    target: str = "oldest"
    keys: str = "*"
    """s3_ambiguous: glob of the object keys whose write answers are dropped ('*/manifest.json',
    'latest'; without a '/' it matches the key's last component)."""
    drops: int = 1
    """s3_ambiguous: most answers dropped while the window is open (0: every matching one)."""
    expect_restore_source: str | None = None
    """If set, every rank the fault killed must restore from this source (own, buddy, persistent,
    peer, fresh) on its restart, per its ``restore`` event in events.jsonl; else the fault fails."""
    drawn: bool = False
    """True when ``random = true`` chose the step and target."""

    @property
    def takes_group_down(self) -> bool:
        return self.kind in _GROUP_DOWN_KINDS

    def describe(self) -> dict[str, Any]:
        keys = {"kind", "at_step", "at_time_s", "drawn", *FAULT_KINDS[self.kind][0], *FAULT_KINDS[self.kind][1]}
        if self.kind == "slow_rank":
            keys.discard("delay_s" if self.duty else "duty")
        return {k: v for k, v in asdict(self).items() if k in keys and v is not None}


@dataclass(kw_only=True, slots=True)
class CheckSpec:
    """``[check]``: the verdict's parameters."""

    twin: bool = True
    """Run (or reuse from the cache) the fault-free twin and compare with it."""
    max_steps_lost_per_fault: int = 2
    twin_atol: float = 1e-5
    """Largest |run - twin| of any parameter or optimizer element accepted when some step ran with a
    different set of groups than in the twin (the sums differ in their last bits, Adam amplifies
    them); with the same groups in every step the run must be bit-identical."""
    verify: bool = True
    """Verify every committed step (every chunk read and checksummed)."""
    compare_set: list[str] = field(default_factory=list)
    """Run the same job and fault schedule again with these ``--set`` overrides on top (e.g. the
    fixed cadence a run with ``checkpoint.cadence = 'adaptive'`` started from): this run's lost work
    (steps recomputed + checkpoint stalls, seconds) must be no worse (``no_worse_than_compare``)."""
    expect_shorter_ram: bool = False
    """A ``cadence`` event must set the RAM interval below the configured ``memory_every``."""

    def __post_init__(self) -> None:
        if not isinstance(self.compare_set, list) or not all(isinstance(s, str) and "=" in s for s in self.compare_set):
            raise ConfigError(f"check.compare_set={self.compare_set!r} must be a list of 'key=value' strings")
        if not isinstance(self.expect_shorter_ram, bool):
            raise ConfigError(f"check.expect_shorter_ram={self.expect_shorter_ram!r} must be true or false")
        if not isinstance(self.twin, bool) or not isinstance(self.verify, bool):
            raise ConfigError(f"check.twin={self.twin!r} and check.verify={self.verify!r} must be true or false")
        _int("check.max_steps_lost_per_fault", self.max_steps_lost_per_fault, 0)
        _number("check.twin_atol", self.twin_atol, 0.0, 1e6)


@dataclass(kw_only=True, slots=True)
class Scenario:
    name: str
    path: str
    job: JobSpec
    faults: list[FaultSpec]
    check: CheckSpec
    seed: int

    def twin_key(self) -> dict[str, Any]:
        """What determines the fault-free twin's numbers (not the faults, pacing or storage)."""
        with open(self.job.config, "rb") as f:
            recipe = hashlib.sha256(f.read()).hexdigest()
        job = self.job
        return {
            "recipe": recipe,
            "groups": job.replica_groups,
            "nproc": job.nproc_per_group,
            "steps": job.steps,
            "ranks_per_node": job.ranks_per_node,
            "set": sorted(job.set),
        }


def _job(table: object, base: Path) -> JobSpec:
    if not isinstance(table, dict):
        raise ConfigError("the scenario needs a [job] table (config, replica_groups, nproc_per_group, steps, ...)")
    allowed = set(JobSpec.__dataclass_fields__)
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [job]; allowed: {sorted(allowed)}")
    if "config" not in table:
        raise ConfigError("[job] needs config = 'configs/....toml' (the training recipe)")
    return JobSpec(**{**table, "config": resolve_path(table["config"], base, "job.config")})


def resolve_path(value: object, base: Path, where: str) -> str:
    """An absolute path: as given, else relative to the cwd, the scenario's folder or the repo root."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}={value!r} must be a path")
    for root in (Path.cwd(), base, REPO_ROOT):
        candidate = root / value
        if candidate.is_file():
            return str(candidate.resolve())
    raise ConfigError(f"{where}={value!r} not found (looked relative to the cwd, {base} and {REPO_ROOT})")


def _faults(items: object, job: JobSpec, rng: random.Random) -> list[FaultSpec]:
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
        raise ConfigError("[[fault]] must be an array of tables")
    out: list[FaultSpec] = []
    for i, table in enumerate(items):
        for fault in _expand(i, table, job, rng):
            out.append(replace(fault, index=len(out)))
    return out


def _expand(i: int, table: dict[str, Any], job: JobSpec, rng: random.Random) -> list[FaultSpec]:
    where = f"fault[{i}]"
    kind = table.get("kind")
    if kind not in FAULT_KINDS:
        raise ConfigError(f"{where}.kind={kind!r} is not a fault kind; allowed: {sorted(FAULT_KINDS)}")
    required, optional = FAULT_KINDS[kind]
    where = f"fault[{i}] ({kind})"
    unknown = sorted(set(table) - _TIMING_KEYS - required - optional)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; {kind} takes {sorted(required | optional)} "
            f"and timing keys {sorted(_TIMING_KEYS - {'kind'})}"
        )
    is_random = table.get("random", False)
    if not isinstance(is_random, bool):
        raise ConfigError(f"{where}.random={is_random!r} must be true or false")
    timing = [k for k in ("at_step", "at_time_s") if k in table]
    if len(timing) + is_random != 1:
        raise ConfigError(
            f"{where}: give exactly one of at_step, at_time_s or random = true (got {timing or 'none'}"
            f"{' and random' if is_random else ''})"
        )
    missing = sorted(required - set(table)) if not is_random else []
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing} (or set random = true to draw them)")
    count = _int(f"{where}.count", table.get("count", 1), 1, 1000)
    if count > 1 and not is_random:
        raise ConfigError(f"{where}.count={count} needs random = true (distinct drawn steps)")
    low = _int(f"{where}.min_step", table.get("min_step", 2), 1, job.steps - 1)
    high = _int(f"{where}.max_step", table.get("max_step", max(low, job.steps - 3)), low, job.steps - 1)
    if is_random and count > high - low + 1:
        raise ConfigError(f"{where}.count={count} > the {high - low + 1} steps in [min_step={low}, max_step={high}]")
    steps = sorted(rng.sample(range(low, high + 1), count)) if is_random else [None]
    out = []
    for step in steps:
        values = {k: table[k] for k in required | optional if k in table}
        if kind == "slow_rank" and "delay_s" not in values:
            values.setdefault("duty", DEFAULT_DUTY)
        elif kind == "slow_rank" and "duty" in values:
            raise ConfigError(
                f"{where}: give duty (stopped from outside) or delay_s (a sleep in its own compute), not both"
            )
        if is_random:
            values.setdefault("group", rng.randrange(job.replica_groups))
            values.setdefault("rank", rng.randrange(job.nproc_per_group))
            values.setdefault("node", rng.randrange(job.nproc_per_group // (job.ranks_per_node or job.nproc_per_group)))
        fault = FaultSpec(
            kind=kind,
            at_step=step if is_random else table.get("at_step"),
            at_time_s=table.get("at_time_s"),
            drawn=is_random,
            **{"seconds": _DEFAULT_SECONDS.get(kind, 0.0), **values},
        )
        _validate(where, fault, job)
        out.append(fault)
    return out


def _validate(where: str, fault: FaultSpec, job: JobSpec) -> None:
    if fault.at_step is not None:
        _int(f"{where}.at_step", fault.at_step, 1, job.steps - 1)
    if fault.at_time_s is not None:
        _number(f"{where}.at_time_s", fault.at_time_s, 0.0, job.timeout_s)
    _int(f"{where}.group", fault.group, 0, job.replica_groups - 1)
    _int(f"{where}.rank", fault.rank, 0, job.nproc_per_group - 1)
    nodes = job.nproc_per_group // (job.ranks_per_node or job.nproc_per_group)
    _int(f"{where}.node", fault.node, 0, nodes - 1)
    _number(f"{where}.seconds", fault.seconds, 0.0, 3600.0)
    _number(f"{where}.rate", fault.rate, 0.0, 1.0)
    _number(f"{where}.delay_s", fault.delay_s, 0.0, 60.0)
    if not isinstance(fault.keys, str) or not fault.keys:
        raise ConfigError(f"{where}.keys={fault.keys!r} must be a non-empty glob such as '*/manifest.json'")
    _int(f"{where}.drops", fault.drops, 0, 10_000)
    if fault.expect_restore_source is not None and fault.expect_restore_source not in SOURCES:
        raise ConfigError(
            f"{where}.expect_restore_source={fault.expect_restore_source!r} must be one of {list(SOURCES)}"
        )
    if fault.target not in ("oldest", "newest"):
        raise ConfigError(f"{where}.target={fault.target!r} must be one of ['oldest', 'newest']")
    if fault.kind.startswith("s3_") and job.storage != "s3":
        raise ConfigError(f"{where}: {fault.kind} needs job.storage = 's3' (got {job.storage!r})")
    if fault.kind == "corrupt_chunk" and job.storage != "local":
        raise ConfigError(f"{where}: corrupt_chunk flips a byte in a local file: it needs job.storage = 'local'")
    if fault.kind in ("kill_node", "node_away") and not job.ranks_per_node:
        raise ConfigError(f"{where}: {fault.kind} needs job.ranks_per_node (ranks of one simulated node)")
    if fault.kind == "node_away" and job.ranks_per_node == job.nproc_per_group:
        raise ConfigError(f"{where}: node_away needs a second node (job.ranks_per_node < nproc_per_group)")
    if fault.kind == "slow_rank":
        _validate_slow_rank(where, fault, job)
    if fault.kind == "kill_group" and job.replica_groups < 2:
        raise ConfigError(
            f"{where}: kill_group with job.replica_groups=1 leaves no group to heal from; "
            "use kill_rank (the group then restores from storage)"
        )


def _validate_slow_rank(where: str, fault: FaultSpec, job: JobSpec) -> None:
    _int(f"{where}.steps", fault.steps, 1, job.steps)
    if fault.duty:
        if isinstance(fault.duty, bool) or not isinstance(fault.duty, (int, float)) or not 0.05 <= fault.duty <= 0.9:
            raise ConfigError(f"{where}.duty={fault.duty!r} must be a share of the time in [0.05, 0.9]")
    elif fault.delay_s <= 0:
        raise ConfigError(
            f"{where}.delay_s={fault.delay_s} must be > 0 seconds (a slow rank with no delay is no fault)"
        )
    # A drawn or timed span may run past the end (it is cut there); one written down should not.
    if fault.at_step is not None and not fault.drawn and fault.at_step + fault.steps - 1 > job.steps:
        raise ConfigError(
            f"{where}: steps {fault.at_step}..{fault.at_step + fault.steps - 1} (at_step={fault.at_step}, "
            f"steps={fault.steps}) run past job.steps={job.steps}; shorten steps or start earlier"
        )


def parse_scenario(
    data: dict[str, Any], *, name: str = "scenario", path: str = "", seed: int | None = None, base: Path | None = None
) -> Scenario:
    """A validated Scenario from the TOML's dict; ``seed`` overrides ``[job] seed``."""
    unknown = sorted(set(data) - {"job", "fault", "check", "description"})
    if unknown:
        raise ConfigError(f"unknown table(s) {unknown} in the scenario; allowed: [job], [[fault]], [check]")
    job = _job(data.get("job"), base or Path.cwd())
    used_seed = job.seed if seed is None else _int("--seed", seed, 0, 2**31 - 1)
    faults = _faults(data.get("fault"), job, random.Random(used_seed))
    check_table = data.get("check", {})
    if not isinstance(check_table, dict):
        raise ConfigError("[check] must be a table")
    unknown = sorted(set(check_table) - set(CheckSpec.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [check]; allowed: {sorted(CheckSpec.__dataclass_fields__)}")
    return Scenario(name=name, path=path, job=job, faults=faults, check=CheckSpec(**check_table), seed=used_seed)


def load_scenario(path: str, *, seed: int | None = None) -> Scenario:
    """Read a scenario file: a path, or the name of one under ``chaos/scenarios/`` ('smoke')."""
    file = Path(path)
    if not file.is_file() and (SCENARIOS_DIR / f"{path}.toml").is_file():
        file = SCENARIOS_DIR / f"{path}.toml"
    if not file.is_file():
        raise ConfigError(f"scenario {path!r} not found (a .toml path, or one of {list_scenarios()})")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file}: not UTF-8 text (TOML must be): {e.reason}") from e
    except OSError as e:  # no permission, an I/O error
        raise ConfigError(f"cannot read scenario {file}: {e.strerror or e}") from e
    return parse_scenario(data, name=file.stem, path=str(file.resolve()), seed=seed, base=file.resolve().parent)


def list_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIOS_DIR.glob("*.toml"))


def scenario_summary(scenario: Scenario) -> dict[str, Any]:
    return {
        "name": scenario.name,
        "path": scenario.path,
        "seed": scenario.seed,
        "job": {**asdict(scenario.job), "config": os.path.relpath(scenario.job.config, REPO_ROOT)},
        "faults": [f.describe() for f in scenario.faults],
        "check": asdict(scenario.check),
    }


def stable_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
