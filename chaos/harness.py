"""Run a scenario end to end: start the job, inject its faults, get the twin, judge, report.

    report = run_scenario(load_scenario("smoke"), report_dir="runs/chaos/smoke")
    report["passed"]   # True only if every invariant holds

The faulted job runs in ``<report_dir>/run`` (its run.dir), with the launcher's output in
``<report_dir>/launcher.log``; with ``job.storage = "s3"`` a moto server and the fault proxy are
started on 127.0.0.1 and stopped at the end. Everything the harness started is gone when this
returns, whatever happened (a SIGSTOPped rank is continued, leftovers are killed and reported).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from resilient.chaos import compare
from resilient.chaos import invariants as inv
from resilient.chaos.analysis import fault_costs, goodput
from resilient.chaos.hooks import HOLD_FILE, write_atomic
from resilient.chaos.inject import FaultRecord, InjectContext, advance, release
from resilient.chaos.job import JobProcess, harness_overrides, job_store_root, load_job_config
from resilient.chaos.report import write_report, write_timeline
from resilient.chaos.s3_proxy import S3_ENV, FaultProxy, MotoServer
from resilient.chaos.scenario import Scenario, scenario_summary
from resilient.chaos.twin import check_cache_dir, default_cache_dir, get_twin
from resilient.errors import ConfigError, disk_full
from resilient.runfiles import HOOK_EVENTS_FILE, chaos_dir, default_ckpt_url, read_events, read_jsonl

POLL_S = 0.05
HOLD_SETTLE_S = 1.0
"""After every killed group is joining again, let its quorum request reach the lighthouse before
the held groups ask (a quorum then forms with it, and it heals)."""
MARKER = ".resilient-chaos"


def _prepare_dir(report_dir: str) -> None:
    """A fresh report directory; an existing one is only replaced if a previous run of ours made it."""
    if os.path.isdir(report_dir) and os.listdir(report_dir):
        if not os.path.exists(os.path.join(report_dir, MARKER)):
            raise ConfigError(
                f"--report {report_dir} exists and was not written by resilient-chaos: choose an empty or new directory"
            )
        shutil.rmtree(report_dir)
    try:
        os.makedirs(report_dir, exist_ok=True)
        open(os.path.join(report_dir, MARKER), "w").close()
    except OSError as e:
        if disk_full(e):  # the machine's failure: not a directory to choose
            raise
        raise ConfigError(
            f"--report {report_dir} cannot be written ({e.strerror or e}); choose a writable directory"
        ) from e


class _Storage:
    """Where the job checkpoints: a local path, or s3:// through the fault proxy to moto."""

    def __init__(self, scenario: Scenario, report_dir: str) -> None:
        self.moto: MotoServer | None = None
        self.proxy: FaultProxy | None = None
        self.env: dict[str, str] = {}
        run_dir = os.path.join(report_dir, "run")
        self.url = default_ckpt_url(run_dir)
        if scenario.job.storage != "s3":
            return
        try:
            self.moto = MotoServer(os.path.join(report_dir, "moto.log"))
            bucket = f"chaos-{uuid.uuid4().hex[:10]}"
            self.moto.create_bucket(bucket)
            self.proxy = FaultProxy(self.moto.url, seed=scenario.seed)
        except BaseException:
            self.close()  # moto runs in a session of its own: nothing else would ever stop it
            raise
        self.url = f"s3://{bucket}/{scenario.name}"
        self.env = {**S3_ENV, "AWS_ENDPOINT_URL": self.proxy.url}

    @contextlib.contextmanager
    def direct(self):  # noqa: ANN201 (a context manager)
        """The harness's own reads go straight to moto, not through the faults."""
        if self.moto is None:
            yield
            return
        saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
        os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": self.moto.url})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.moto is not None:
            self.moto.close()


class _Holds:
    """Holds the live groups near the end while a killed group is not joining again."""

    def __init__(self, chaos_dir: str, hold_step: int) -> None:
        self.path = os.path.join(chaos_dir, HOLD_FILE)
        self.hold_step = hold_step
        self.waiting: dict[int, int] = {}
        self._ready_at: float | None = None

    def expect(self, rejoin: dict[int, int]) -> None:
        if not self.hold_step or not rejoin:
            return
        for group, attempt in rejoin.items():
            self.waiting[group] = max(self.waiting.get(group, 0), attempt)
        write_atomic(self.path, str(self.hold_step))
        self._ready_at = None

    def poll(self, attempts: dict[int, int], force: bool = False) -> None:
        if not self.waiting:
            return
        if all(attempts.get(g, 0) >= a for g, a in self.waiting.items()) or force:
            self._ready_at = self._ready_at or time.monotonic()
            if force or time.monotonic() - self._ready_at >= HOLD_SETTLE_S:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
                self.waiting.clear()


def _drive(
    scenario: Scenario, proc: JobProcess, ctx: InjectContext, records: list[FaultRecord], log: Callable[[str], None]
) -> None:
    holds = _Holds(proc.chaos_dir, scenario.job.hold_step)
    t_first_commit: float | None = None
    deadline = time.time() + scenario.job.timeout_s
    cursor = 0
    try:
        while proc.poll():
            new, cursor = proc.events.records[cursor:], len(proc.events.records)
            for e in new:
                if e.get("event") == "step" and e.get("committed"):
                    ctx.job_step = max(ctx.job_step, e["step"])
                    t_first_commit = t_first_commit or e["t"]
                elif e.get("event") == "joining":
                    ctx.attempts[e["group"]] = max(ctx.attempts.get(e["group"], 0), e.get("attempt", 0))
            for record in records:
                before = record.state
                advance(record, ctx, t_first_commit)
                if record.state != before and record.state in ("injected", "done", "failed"):
                    log(
                        f"fault {record.spec.kind} #{record.spec.index}: {record.state} at step {ctx.job_step}"
                        + (f" ({record.note})" if record.note else "")
                    )
                if record.state == "done" and record.rejoin and not record.extra.get("_held"):
                    record.extra["_held"] = True
                    holds.expect(record.rejoin)
            holds.poll(ctx.attempts)
            if time.time() > deadline:
                log(f"job.timeout_s={scenario.job.timeout_s:.0f} s passed: stopping the job")
                proc.timed_out = True
                break
            time.sleep(POLL_S)
    finally:
        for record in records:
            release(record)
            if record.state == "pending":
                record.state, record.note = "failed", f"never injected: the job ended at step {ctx.job_step}"
        holds.poll(ctx.attempts, force=True)
        proc.stop()


def run_scenario(
    scenario: Scenario, report_dir: str, *, cache_dir: str | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run, judge and report one scenario; returns the report (also written to report_dir).

    ``report.json`` is written whatever happens: if the harness itself crashes, the report has
    ``passed: false`` and ``harness_error`` (type, message, traceback), and is returned; a
    ConfigError (a bad recipe override) is re-raised after the report is written."""
    report_dir = os.path.abspath(report_dir)
    if scenario.check.twin:
        check_cache_dir(cache_dir or default_cache_dir())
    _prepare_dir(report_dir)
    path = os.path.join(report_dir, "report.json")
    try:
        report = _run(scenario, report_dir, cache_dir, log)
        if scenario.check.compare_set or scenario.check.expect_shorter_ram:
            _compared(scenario, report, report_dir, cache_dir, log)
    except Exception as e:  # noqa: BLE001 (any crash of the harness still leaves a report)
        report = {
            "passed": False,
            "scenario": scenario_summary(scenario),
            "harness_error": {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()},
        }
        write_report(path, report)
        if isinstance(e, ConfigError):
            raise
        log(f"chaos: the harness crashed ({type(e).__name__}: {e}); report in {path}")
        return report
    write_report(path, report)
    return report


def _compared(
    scenario: Scenario, report: dict[str, Any], report_dir: str, cache_dir: str | None, log: Callable[[str], None]
) -> None:
    """``[check] expect_shorter_ram`` and ``compare_set``: their verdicts join the invariants."""
    checks = {}
    run_dir = report["run"]["dir"]
    if scenario.check.expect_shorter_ram:
        config = load_job_config(scenario.job, harness_overrides(scenario.job, run_dir, ""))
        checks["ram_interval_shortened"] = compare.shorter_ram(read_events(run_dir), config.checkpoint.memory_every)
    if scenario.check.compare_set:
        log(f"chaos: the same faults again with {scenario.check.compare_set}")
        other_dir = compare.compare_dir(report_dir)
        other = run_scenario(compare.compare_scenario(scenario), other_dir, cache_dir=cache_dir, log=log)
        checks["no_worse_than_compare"] = compare.no_worse(report, other, run_dir, os.path.join(other_dir, "run"))
    for name, verdict in checks.items():
        log(f"  {'ok  ' if verdict['ok'] else 'FAIL'} {name}: {verdict['reason']}")
    report["invariants"].update(checks)
    report["passed"] = all(v["ok"] for v in report["invariants"].values())


def _run(scenario: Scenario, report_dir: str, cache_dir: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    run_dir = os.path.join(report_dir, "run")
    storage: _Storage | None = None
    config = None
    try:
        storage = _Storage(scenario, report_dir)
        overrides = harness_overrides(scenario.job, run_dir, storage.url)
        config = load_job_config(scenario.job, overrides)
        proc = JobProcess(
            scenario.job,
            run_dir,
            overrides,
            env=storage.env,
            log_path=os.path.join(report_dir, "launcher.log"),
            step_sleep_s=scenario.job.step_sleep_s,
        )
        records = [FaultRecord(spec=f) for f in scenario.faults]
        ctx = InjectContext(job=proc, config=config, proxy=storage.proxy)
        log(
            f"chaos: {scenario.name}: {scenario.job.replica_groups} groups x {scenario.job.nproc_per_group} ranks, "
            f"{scenario.job.steps} steps, {len(records)} fault(s); run in {run_dir}"
        )
        try:
            _drive(scenario, proc, ctx, records, log)
        finally:
            leftovers = proc.leftovers()
            proc.kill_leftovers(leftovers)
            proc.close()
        run = inv.RunData(
            run_dir=run_dir,
            groups=scenario.job.replica_groups,
            steps=scenario.job.steps,
            checkpoint_url=storage.url,
            events=proc.events.records,
            returncode=proc.returncode,
            timed_out=proc.timed_out,
        )
        log(f"chaos: job ended (exit {proc.returncode}) after {proc.t_end - proc.t_launch:.1f} s; checking")
        with storage.direct():
            return _judge(scenario, run, records, proc, leftovers, storage, cache_dir, report_dir, log)
    finally:
        if storage is not None:
            storage.close()
        _wipe_ram_stores(run_dir, config)


def _load_twin(
    scenario: Scenario, run: inv.RunData, cache_dir: str | None, log: Callable[[str], None]
) -> tuple[inv.RunData | None, dict[str, Any], str]:
    """The fault-free twin's run data (computed or cached), its info, and why it is missing."""
    if not scenario.check.twin:
        return None, {}, ""
    try:
        twin_dir, twin_info = get_twin(scenario, cache_dir or default_cache_dir(), log)
    except Exception as e:  # noqa: BLE001 (no twin is a failed twin_match, not a crash of the harness)
        twin_error = f"the fault-free twin could not be computed: {type(e).__name__}: {e}"
        log(f"chaos: {twin_error}")
        return None, {"error": twin_error}, twin_error
    twin = inv.RunData(
        run_dir=twin_dir, groups=run.groups, steps=run.steps, checkpoint_url=default_ckpt_url(twin_dir), returncode=0
    )
    twin.events = read_events(twin_dir)
    return twin, twin_info, ""


def _invariants(
    scenario: Scenario,
    run: inv.RunData,
    costs: list[dict[str, Any]],
    twin: inv.RunData | None,
    twin_verdict: dict[str, Any],
    leftovers: list[dict[str, Any]],
    storage: _Storage,
) -> dict[str, dict[str, Any]]:
    corrupted = {c["step"]: c["file"] for c in costs if c["kind"] == "corrupt_chunk" and "step" in c}
    config = load_job_config(scenario.job, harness_overrides(scenario.job, run.run_dir, storage.url))
    check = scenario.check
    return {
        "finished": inv.finished(run, scenario.job.timeout_s),
        "commits_verify": inv.commits_verify(run, corrupted)
        if check.verify
        else inv.result(True, "not checked (check.verify = false)"),
        "exactly_once": inv.exactly_once(run, config.data.pipeline.num_samples, twin),
        "replicas_identical": inv.replicas_identical(run),
        "twin_match": twin_verdict,
        "steps_lost_within_bound": inv.steps_lost_within_bound(costs, check.max_steps_lost_per_fault),
        "no_orphans": inv.no_orphans(leftovers),
        "storage_faults_absorbed": inv.storage_faults_absorbed(run, [f.kind for f in scenario.faults]),
        "slowed_rank_named": inv.slowed_rank_named(
            run, [(f.group, f.rank) for f in scenario.faults if f.kind == "slow_rank"]
        ),
        "final_step_durable": inv.final_step_durable(run, verify=check.verify),
        "ram_restores_on_branch": inv.ram_restores_on_branch(run),
    }


def _judge(
    scenario: Scenario,
    run: inv.RunData,
    records: list[FaultRecord],
    proc: JobProcess,
    leftovers: list[dict[str, Any]],
    storage: _Storage,
    cache_dir: str | None,
    report_dir: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    twin, twin_info, twin_error = _load_twin(scenario, run, cache_dir, log)
    costs = [fault_costs(r, run.events) for r in records]
    twin_details: dict[str, Any] = {}
    if twin_error:
        twin_verdict = inv.result(False, twin_error)
    elif run.final(0) is None:
        twin_verdict = inv.result(False, "the run has no final state to compare")
    else:
        twin_verdict, twin_details = inv.twin_match(run, twin, scenario.check.twin_atol)
    invariants = _invariants(scenario, run, costs, twin, twin_verdict, leftovers, storage)
    holds = read_jsonl(os.path.join(chaos_dir(run.run_dir), HOOK_EVENTS_FILE))
    t_end = proc.t_end or time.time()
    good = goodput(costs, run.events, holds, proc.t_launch, t_end)
    passed = all(v["ok"] for v in invariants.values())
    for name, verdict in invariants.items():
        log(f"  {'ok  ' if verdict['ok'] else 'FAIL'} {name}: {verdict['reason']}")
    title = f"{scenario.name} (seed {scenario.seed}): {'PASSED' if passed else 'FAILED'}"
    write_timeline(os.path.join(report_dir, "timeline.png"), run, twin, costs, holds, proc.t_launch, title)
    public_costs = [{k: v for k, v in c.items() if not k.startswith("_")} for c in costs]
    return {
        "passed": passed,
        "scenario": scenario_summary(scenario),
        "invariants": invariants,
        "faults": public_costs,
        "goodput": good,
        "twin": {**twin_info, **twin_details} if scenario.check.twin else None,
        "s3_proxy": storage.proxy.counts if storage.proxy else None,
        "run": {
            "dir": run.run_dir,
            "exit_code": proc.returncode,
            "wall_s": round(t_end - proc.t_launch, 2),
            "restarts": sorted(
                (e["group"], e["attempt"])
                for e in run.events
                if e.get("event") == "joining" and e.get("attempt", 0) > 0
            ),
        },
    }


def _wipe_ram_stores(run_dir: str, config: Any) -> None:
    """The RAM tier's node stores of this run (under /dev/shm by default) must not outlive it."""
    if config is None or not getattr(config.checkpoint, "memory_every", 0):
        return
    shutil.rmtree(job_store_root(config, run_dir), ignore_errors=True)
