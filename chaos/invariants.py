"""The verdict: each invariant is {"ok": bool, "reason": str}, from what the job left behind.

- ``finished``: the launcher exited 0 in time and every group wrote final.json at the last step;
- ``commits_verify``: every committed step verifies (every chunk read and checksummed); a step the
  scenario corrupted on purpose must FAIL verification, naming the flipped file (the invariant is
  then about detection: a corruption that verifies clean is the failure);
- ``exactly_once``: every step 1..N committed one global batch (groups agree), no sample twice,
  every complete epoch fully covered, and each step's samples equal to the twin's;
- ``replicas_identical``: groups that committed a step hold bit-identical parameters after it
  (per-step digests from the chaos hook, so a bad heal is caught at its step; with several groups at
  least one step must have been compared), and the final parameter and optimizer digests agree;
- ``twin_match``: the final checkpoint equals the twin's bit for bit when every step ran with the
  same groups as in the twin; otherwise within ``check.twin_atol``;
- ``steps_lost_within_bound``: each fault's ``steps_lost`` <= ``check.max_steps_lost_per_fault``,
  every fault was injected, and a fault's killed ranks restored from its ``expect_restore_source``;
- ``no_orphans``: no process the job started is alive after the launcher exited;
- ``storage_faults_absorbed``: when no fault kills or stops a process (only S3 trouble, flipped
  bytes), no group restarted and no save failed: storage faults are retried inside the saves, and
  an ambiguous answer is resolved, never taken for a failure that crashes a group;
- ``slowed_rank_named``: with ``slow_rank`` faults, each slowed rank is named by a ``straggler``
  event and no other rank is;
- ``ram_restores_on_branch``: every rank that restored from RAM took a snapshot of the timeline it
  branched from, or of an ancestor no later than that ancestor's branch step (a node back from an
  absence must not restore a step it took before the others retrained it);
- ``final_step_durable``: the run's last step is committed to ``checkpoint.url`` and verifies
  (a run that ends, even with exit 0, while its final state lives only in RAM or in a save that
  never committed has lost it).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from resilient.chaos.hooks import digest_path
from resilient.chaos.scenario import PROCESS_KINDS
from resilient.runfiles import (
    FINAL_DIGEST,
    SAMPLES_FILE,
    SAVES_FILE,
    chaos_dir,
    group_file,
    read_jsonl,
    read_jsonl_by_step,
)


def result(ok: bool, reason: str) -> dict[str, Any]:
    return {"ok": bool(ok), "reason": reason}


@dataclass(slots=True)
class RunData:
    """The outputs of one job (the faulted run or its twin)."""

    run_dir: str
    groups: int
    steps: int
    checkpoint_url: str
    events: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    timed_out: bool = False

    def group_file(self, group: int, name: str) -> str:
        return group_file(self.run_dir, name, group)

    def by_step(self, group: int, name: str) -> dict[int, dict[str, Any]]:
        path = self.group_file(group, name)
        return read_jsonl_by_step(path) if os.path.exists(path) else {}

    def final(self, group: int) -> dict[str, Any] | None:
        try:
            with open(self.group_file(group, FINAL_DIGEST)) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def samples(self) -> tuple[dict[int, list[str]], list[str]]:
        """step -> sample ids (groups merged) and the disagreements found while merging."""
        out: dict[int, list[str]] = {}
        problems = []
        for group in range(self.groups):
            for step, record in self.by_step(group, SAMPLES_FILE).items():
                if step in out and out[step] != record["sample_ids"]:
                    problems.append(f"groups disagree on the samples of step {step}")
                out[step] = record["sample_ids"]
        return out, problems

    def participants(self) -> dict[int, int]:
        """step -> groups in the quorum that committed it (the last commit of each step counts)."""
        out: dict[int, int] = {}
        for e in sorted(self.events, key=lambda e: e["t"]):
            if e.get("event") == "step" and e.get("committed"):
                out[e["step"]] = e["participants"]
        return out

    def digests(self, group: int) -> dict[int, dict[str, Any]]:
        """step -> the group's parameter digest, only records of the job's current lineage (after the
        last storage restore, a step redone supersedes what was computed before it)."""
        restores = [e for e in self.events if e.get("event") == "start" and e.get("source") == "persistent"]
        last = max(restores, key=lambda e: e["t"], default=None)
        cut, restored = (last["t"], last["step"]) if last else (0.0, 0)
        out: dict[int, dict[str, Any]] = {}
        for record in read_jsonl(digest_path(chaos_dir(self.run_dir), group)):
            if record["t"] >= cut or record["step"] <= restored:
                out[record["step"]] = record
        return out


def finished(run: RunData, timeout_s: float) -> dict[str, Any]:
    if run.timed_out:
        return result(False, f"the job did not end within job.timeout_s={timeout_s:.0f} s and was stopped")
    if run.returncode != 0:
        return result(False, f"the launcher exited {run.returncode} (see logs/ in the run directory)")
    finals = {g: run.final(g) for g in range(run.groups)}
    short = {g: (f or {}).get("step") for g, f in finals.items() if not f or f.get("step") != run.steps}
    if short:
        return result(False, f"groups without final.json at step {run.steps}: {short}")
    return result(True, f"launcher exited 0; all {run.groups} groups ended at step {run.steps}")


def commits_verify(run: RunData, corrupted: dict[int, str]) -> dict[str, Any]:
    from resilient.storage.offline.catalog import list_checkpoint, open_checkpoint
    from resilient.storage.offline.verify import verify_step

    try:
        listing = list_checkpoint(run.checkpoint_url)
    except Exception as e:  # noqa: BLE001 (any failure to list is the finding)
        return result(False, f"cannot list {run.checkpoint_url}: {e}")
    committed = [s["step"] for s in listing["steps"] if s["committed"]]
    if not committed:
        return result(False, f"no committed step under {run.checkpoint_url}")
    bad, detected, missed = [], [], []
    for step in committed:
        try:
            report = verify_step(open_checkpoint(run.checkpoint_url, step))
            problems = [f"{p.kind} {p.fqn} {p.chunk}" for p in report.problems]
        except Exception as e:  # noqa: BLE001 (a step that cannot be opened is a finding too)
            problems = [f"{type(e).__name__}: {e}"]
        if step in corrupted:
            (detected if problems else missed).append(f"step {step} ({corrupted[step]}): {'; '.join(problems)[:300]}")
        elif problems:
            bad.append(f"step {step}: {'; '.join(problems)[:300]}")
    pruned = sorted(set(corrupted) - set(committed))
    if bad or missed:
        why = [f"{len(bad)} committed step(s) fail verification: {bad[:3]}"] if bad else []
        why += [f"injected corruption NOT detected: {missed}"] if missed else []
        return result(False, "; ".join(why))
    reason = f"{len(committed)} committed steps verify ({committed[0]}..{committed[-1]})"
    if detected:
        reason += f"; injected corruption detected: {detected}"
    if pruned:
        reason += f"; corrupted step(s) {pruned} were pruned by retention before the check"
    return result(True, reason)


def final_step_durable(run: RunData, verify: bool = True) -> dict[str, Any]:
    from resilient.storage.offline.catalog import list_checkpoint, open_checkpoint
    from resilient.storage.offline.verify import verify_step

    step, url = run.steps, run.checkpoint_url
    try:
        listing = list_checkpoint(url)
    except Exception as e:  # noqa: BLE001 (any failure to list is the finding)
        return result(False, f"cannot list {url}: {type(e).__name__}: {e}")
    committed = [s["step"] for s in listing["steps"] if s["committed"]]
    if step not in committed:
        newest = committed[-1] if committed else None
        return result(False, f"the last step {step} is not committed to {url} (newest committed: {newest})")
    if not verify:
        return result(True, f"step {step} is committed to {url} (not verified: check.verify = false)")
    try:
        problems = [f"{p.kind} {p.fqn} {p.chunk}" for p in verify_step(open_checkpoint(url, step)).problems]
    except Exception as e:  # noqa: BLE001 (a final step that cannot be opened is the finding)
        problems = [f"{type(e).__name__}: {e}"]
    if problems:
        return result(False, f"the last step {step} is committed to {url} but fails verification: {problems[:3]}")
    return result(True, f"the last step {step} is committed to {url} and verifies")


def storage_faults_absorbed(run: RunData, fault_kinds: list[str]) -> dict[str, Any]:
    process = sorted(set(fault_kinds) & PROCESS_KINDS)
    if process:
        return result(True, f"not checked: faults {process} kill or stop processes")
    restarts = sorted(
        {(e["group"], e["attempt"]) for e in run.events if e.get("event") == "joining" and e.get("attempt", 0) > 0}
    )
    failed = []
    for group in range(run.groups):
        path = run.group_file(group, SAVES_FILE)
        records = read_jsonl(path) if os.path.exists(path) else []
        failed += [f"group {group} step {r.get('step')}" for r in records if r.get("outcome") == "failed"]
    if restarts or failed:
        why = [f"groups restarted (group, attempt): {restarts}"] if restarts else []
        why += [f"saves failed: {failed[:5]}"] if failed else []
        return result(False, f"no fault killed a process, yet {'; '.join(why)} (see logs/ in the run directory)")
    kinds = sorted(set(fault_kinds)) or "none"
    # (A slowed rank stops no process either: "faults", not "storage faults".)
    return result(
        True, f"faults {kinds}, none stopping a process: no group restarted, every save committed or was skipped"
    )


def slowed_rank_named(run: RunData, slowed: list[tuple[int, int]]) -> dict[str, Any]:
    """Every (group, rank) a ``slow_rank`` fault slowed is named by a ``straggler`` event, and no
    other rank is (a waiter named beside the one it waits for is the failure this catches); a whole
    group named (rank None) counts as (group, -1)."""
    if not slowed:
        return result(True, "not checked: no slow_rank fault")
    named = sorted(
        {(int(e.get("group", 0)), int(e.get("rank", -1) if e.get("rank") is not None else -1))
         for e in run.events if e.get("event") == "straggler"}
    )  # fmt: skip
    missed = sorted(set(slowed) - set(named))
    wrong = sorted(set(named) - set(slowed))
    if missed or wrong:
        why = [f"slowed but not named (group, rank): {missed}"] if missed else []
        why += [f"named but not slowed: {wrong}"] if wrong else []
        return result(False, "; ".join(why))
    return result(True, f"the slowed (group, rank) {sorted(set(slowed))} and only they were named stragglers")


def exactly_once(run: RunData, num_samples: int, twin: RunData | None) -> dict[str, Any]:
    by_step, problems = run.samples()
    if problems:
        return result(False, problems[0])
    missing = sorted(set(range(1, run.steps + 1)) - set(by_step))
    if missing:
        return result(False, f"steps with no committed samples: {missing[:10]}")
    seen = Counter(sid for ids in by_step.values() for sid in ids)
    twice = [sid for sid, n in seen.items() if n > 1]
    if twice:
        return result(False, f"{len(twice)} sample(s) consumed twice, e.g. {twice[:5]}")
    epochs = Counter(int(sid.split(":")[0]) for sid in seen)
    short = {e: epochs[e] for e in range(max(epochs)) if epochs[e] != num_samples}
    if short:
        return result(False, f"complete epochs not fully covered (samples per epoch, want {num_samples}): {short}")
    if twin is not None:
        twin_steps, _ = twin.samples()
        differ = [s for s in range(1, run.steps + 1) if sorted(twin_steps.get(s, [])) != sorted(by_step[s])]
        if differ:
            return result(False, f"steps whose samples differ from the twin's: {differ[:10]}")
    return result(
        True,
        f"{len(seen)} samples over steps 1..{run.steps}, none twice, every full epoch covered"
        + (", same samples per step as the twin" if twin is not None else ""),
    )


def replicas_identical(run: RunData) -> dict[str, Any]:
    digests = {g: run.digests(g) for g in range(run.groups)}
    compared = 0
    for step in range(1, run.steps + 1):
        values = {g: d[step]["params_sha256"] for g, d in digests.items() if step in d}
        if len(values) > 1:
            compared += 1
            if len(set(values.values())) > 1:
                return result(
                    False,
                    f"groups hold different parameters after step {step}: { {g: v[:12] for g, v in values.items()} }",
                )
    finals = {g: run.final(g) for g in range(run.groups)}
    if any(f is None for f in finals.values()):
        return result(False, f"final.json missing for groups {[g for g, f in finals.items() if f is None]}")
    for key in ("params_sha256", "optim_sha256"):
        if len({f[key] for f in finals.values()}) > 1:
            return result(False, f"final {key} differs between groups: { {g: f[key][:12] for g, f in finals.items()} }")
    if run.groups == 1:
        return result(True, "one replica group: nothing to compare")
    if not compared:
        # Several groups yet no step to compare: the digests are missing (the chaos hook did not run,
        # or wrote elsewhere), and equal finals alone would miss a bad heal that training later masked.
        counts = {g: len(d) for g, d in digests.items()}
        return result(
            False,
            f"no step has digests from two groups (digest records per group: {counts}): "
            "per-step replica equality was not checked; did the chaos hook load?",
        )
    return result(True, f"bit-identical at all {compared} steps committed by several groups and at the end")


def twin_match(run: RunData, twin: RunData | None, atol: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The verdict and details (first step whose parameters differ from the twin's, max |diff|)."""
    if twin is None:
        return result(True, "no twin (check.twin = false)"), {}
    details: dict[str, Any] = {}
    run_final, twin_final = run.final(0), twin.final(0)
    if run_final is None or twin_final is None:
        return result(False, "final.json missing in the run or in the twin"), details
    mine, theirs = run.digests(0), twin.digests(0)
    details["first_step_differing_from_twin"] = next(
        (
            s
            for s in range(1, run.steps + 1)
            if s in mine and s in theirs and mine[s]["params_sha256"] != theirs[s]["params_sha256"]
        ),
        None,
    )
    run_p, twin_p = run.participants(), twin.participants()
    other = [s for s in range(1, run.steps + 1) if run_p.get(s) != twin_p.get(s)]
    details["steps_with_other_participants"] = other
    same = all(run_final[k] == twin_final[k] for k in ("params_sha256", "optim_sha256"))
    if same:
        return result(True, "final parameters and optimizer state bit-identical to the twin"), details
    from resilient.storage.offline.catalog import open_checkpoint
    from resilient.storage.offline.diff import diff_steps

    try:
        diff = diff_steps(
            open_checkpoint(run.checkpoint_url, run.steps), open_checkpoint(twin.checkpoint_url, twin.steps)
        )
    except Exception as e:  # noqa: BLE001 (a final checkpoint that cannot be read is the finding)
        return result(
            False,
            f"final state differs from the twin's and step {run.steps} cannot be compared "
            f"({run.checkpoint_url} vs {twin.checkpoint_url}): {type(e).__name__}: {e}",
        ), details
    tensors = [d for d in diff["changed"] if not d["fqn"].startswith("rng")]
    worst = max((float(d["max_abs_diff"]) for d in tensors), default=0.0)
    details["max_abs_diff"] = worst
    details["values_changed"] = diff.get("values_changed", [])[:10]
    if not other:
        return result(
            False,
            f"every step ran with the twin's groups, yet the final state differs (max |diff| "
            f"{worst:.3g}, first differing step {details['first_step_differing_from_twin']})",
        ), details
    if worst <= atol:
        return result(
            True,
            f"within twin_atol={atol:g} (max |diff| {worst:.3g}): steps {other[:8]} ran with other "
            "groups than in the twin, so their sums differ in the last bits",
        ), details
    return result(
        False,
        f"max |diff| {worst:.3g} > twin_atol={atol:g} (first differing step "
        f"{details['first_step_differing_from_twin']})",
    ), details


def steps_lost_within_bound(costs: list[dict[str, Any]], bound: int) -> dict[str, Any]:
    over = [f"{c['kind']}@{c['at_step']}: {c['steps_lost']}" for c in costs if c["steps_lost"] > bound]
    failed = [f"{c['kind']}: {c['note']}" for c in costs if c["state"] == "failed"]
    wrong_source = [
        f"{c['kind']}@{c['at_step']}: {c['restore_check'].get('reason')}"
        for c in costs
        if c.get("restore_check") and not c["restore_check"]["ok"]
    ]
    if over:
        return result(False, f"faults that lost more than {bound} steps: {over}")
    if failed:
        return result(False, f"faults that could not be injected: {failed}")
    if wrong_source:
        return result(False, f"faults whose killed ranks did not restore from the expected source: {wrong_source}")
    lost = [c["steps_lost"] for c in costs]
    return result(True, f"steps lost per fault {lost} <= {bound}" if lost else "no faults")


def no_orphans(leftovers: list[dict[str, Any]]) -> dict[str, Any]:
    if leftovers:
        return result(
            False,
            f"{len(leftovers)} process(es) of the job still alive after the launcher exited "
            f"(killed by the harness): {leftovers[:3]}",
        )
    return result(True, "no process of the job left (launcher, lighthouse, torchruns, ranks)")


def ram_restores_on_branch(run: RunData) -> dict[str, Any]:
    """Each RAM restore event's snapshot timeline is one its new timeline keeps eligible at the
    restored step (``ancestors``: the parent up to the branch step, older ones up to theirs)."""
    restores = [e for e in run.events if e.get("event") == "restore" and e.get("source") in ("own", "buddy")]
    wrong = []
    for e in restores:
        eligible = sorted(t for t, newest in e.get("ancestors") or [] if e["step"] <= newest)
        if e.get("snapshot_timeline") not in eligible:
            wrong.append(
                f"group {e['group']} rank {e['rank']} restored step {e['step']} of timeline "
                f"{e.get('snapshot_timeline')!r}, not of {eligible or 'any eligible one'}"
            )
    if wrong:
        return result(False, f"{len(wrong)} RAM restore(s) off the current branch: " + "; ".join(wrong[:3]))
    if not restores:
        return result(True, "no restore from RAM")
    return result(True, f"{len(restores)} rank restore(s) from RAM, each of a snapshot on the current branch")
