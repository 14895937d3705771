"""Each of the ten invariants can fail: judged on the smallest fake run data (no job is run).

A check that cannot fail proves nothing; these pin down what each one catches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from resilient.chaos import invariants as inv
from resilient.chaos.hooks import digest_path
from resilient.runfiles import FINAL_DIGEST

pytestmark = [pytest.mark.timeout(60)]

STEPS = 3


def _write_lines(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _run(tmp_path: Path, groups: int = 2, **kwargs: object) -> inv.RunData:
    fields = {"returncode": 0, **kwargs}
    return inv.RunData(
        run_dir=str(tmp_path / "run"),
        groups=groups,
        steps=STEPS,
        checkpoint_url=str(tmp_path / "run" / "ckpt"),
        **fields,
    )


def _final(run: inv.RunData, group: int, step: int = STEPS, params: str = "p" * 64, optim: str = "o" * 64) -> None:
    path = run.group_file(group, FINAL_DIGEST)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_text(json.dumps({"step": step, "params_sha256": params, "optim_sha256": optim}))


def _samples(run: inv.RunData, group: int, by_step: dict[int, list[str]]) -> None:
    _write_lines(run.group_file(group, "samples.jsonl"), [{"step": s, "sample_ids": ids} for s, ids in by_step.items()])


def _digests(run: inv.RunData, group: int, by_step: dict[int, str]) -> None:
    _write_lines(
        digest_path(os.path.join(run.run_dir, "chaos"), group),
        [{"t": float(s), "step": s, "params_sha256": d} for s, d in by_step.items()],
    )


def test_finished_fails_on_timeout_exit_code_and_short_final(tmp_path: Path) -> None:
    run = _run(tmp_path, timed_out=True)
    assert not inv.finished(run, 30)["ok"] and "did not end within" in inv.finished(run, 30)["reason"]
    run = _run(tmp_path, returncode=1)
    assert inv.finished(run, 30) == inv.result(False, "the launcher exited 1 (see logs/ in the run directory)")
    run = _run(tmp_path)
    _final(run, 0)
    _final(run, 1, step=STEPS - 1)
    verdict = inv.finished(run, 30)
    assert not verdict["ok"] and f"{{1: {STEPS - 1}}}" in verdict["reason"]
    _final(run, 1)
    assert inv.finished(run, 30)["ok"]


def test_commits_verify_fails_on_a_bad_step_and_on_an_undetected_corruption(tmp_path: Path) -> None:
    import torch

    from resilient import Checkpointer

    run = _run(tmp_path)
    assert not inv.commits_verify(run, {})["ok"], "no checkpoint at all"
    ckpt = Checkpointer(run.checkpoint_url, config=None)
    ckpt.save(1, {"w": torch.arange(4096, dtype=torch.float32)}).wait()
    ckpt.save(2, {"w": torch.ones(4096)}).wait()
    assert inv.commits_verify(run, {})["ok"]
    # The scenario says it corrupted step 1, but nothing was flipped: detection missed it.
    verdict = inv.commits_verify(run, {1: "w/0"})
    assert not verdict["ok"] and "injected corruption NOT detected" in verdict["reason"]
    _flip_a_chunk_byte(os.path.join(run.checkpoint_url, "step-000000002"))
    verdict = inv.commits_verify(run, {})
    assert not verdict["ok"] and "1 committed step(s) fail verification" in verdict["reason"], verdict
    assert inv.commits_verify(run, {2: "w"})["ok"], "a corruption the scenario made, and detected, passes"


def _flip_a_chunk_byte(step_dir: str) -> None:
    """Flip the middle byte of the step's first shard, where the manifest says it lies in its pack."""
    manifest = json.loads(Path(step_dir, "manifest.json").read_text())
    entry = next(a for _, a in sorted(manifest["arrays"].items()) if a["shards"])
    pack, offset, nbytes = next(iter(entry["shards"].values()))
    path = Path(step_dir, manifest["attempt"], pack)
    data = bytearray(path.read_bytes())
    data[offset + nbytes // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_final_step_durable_fails_unless_the_last_step_is_committed_and_verifies(tmp_path: Path) -> None:
    import torch

    from resilient import Checkpointer

    run = _run(tmp_path)
    verdict = inv.final_step_durable(run)
    assert not verdict["ok"] and verdict["reason"].startswith(f"cannot list {run.checkpoint_url}: StorageError")
    ckpt = Checkpointer(run.checkpoint_url, config=None)
    for step in range(1, STEPS):
        ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
    # A run that ended at its last step while that step lives only in RAM (or never committed).
    verdict = inv.final_step_durable(run)
    assert verdict == inv.result(
        False, f"the last step {STEPS} is not committed to {run.checkpoint_url} (newest committed: {STEPS - 1})"
    )
    ckpt.save(STEPS, {"w": torch.arange(4096, dtype=torch.float32)}).wait()
    assert inv.final_step_durable(run) == inv.result(
        True, f"the last step {STEPS} is committed to {run.checkpoint_url} and verifies"
    )
    _flip_a_chunk_byte(os.path.join(run.checkpoint_url, f"step-{STEPS:09d}"))
    verdict = inv.final_step_durable(run)
    assert not verdict["ok"] and "committed to" in verdict["reason"] and "fails verification" in verdict["reason"]
    assert inv.final_step_durable(run, verify=False)["ok"], "check.verify = false: committed is enough"


def test_storage_faults_absorbed_fails_on_a_restart_or_a_failed_save_without_a_kill(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _write_lines(run.group_file(0, "saves.jsonl"), [{"step": 4, "outcome": "committed"}])
    _write_lines(run.group_file(1, "saves.jsonl"), [{"step": 8, "outcome": "skipped"}])
    assert inv.storage_faults_absorbed(run, ["s3_ambiguous"]) == inv.result(
        True,
        "faults ['s3_ambiguous'], none stopping a process: no group restarted, every save committed or was skipped",
    )
    # What a 412 on our own manifest did: "already committed", the save failed, the group restarted.
    _write_lines(run.group_file(1, "saves.jsonl"), [{"step": 8, "outcome": "failed"}])
    run.events = [{"t": 1.0, "event": "joining", "group": 1, "attempt": 1}]
    verdict = inv.storage_faults_absorbed(run, ["s3_ambiguous", "s3_errors"])
    assert verdict == inv.result(
        False,
        "no fault killed a process, yet groups restarted (group, attempt): [(1, 1)]; saves failed: "
        "['group 1 step 8'] (see logs/ in the run directory)",
    )
    assert inv.storage_faults_absorbed(run, ["s3_ambiguous", "kill_rank"]) == inv.result(
        True, "not checked: faults ['kill_rank'] kill or stop processes"
    )


@pytest.mark.parametrize(
    ("group1", "message"),
    [
        ({1: ["0:0", "0:1"], 2: ["0:9", "0:3"], 3: ["0:4", "0:5"]}, "groups disagree on the samples of step 2"),
        ({1: ["0:0", "0:1"], 2: ["0:2", "0:3"]}, None),  # group 0 still has step 3: not missing
    ],
)
def test_exactly_once_fails_when_groups_disagree(tmp_path: Path, group1: dict, message: str | None) -> None:
    run = _run(tmp_path)
    _samples(run, 0, {1: ["0:0", "0:1"], 2: ["0:2", "0:3"], 3: ["0:4", "0:5"]})
    _samples(run, 1, group1)
    verdict = inv.exactly_once(run, num_samples=6, twin=None)
    assert verdict["ok"] is (message is None), verdict
    if message:
        assert message in verdict["reason"]


def test_exactly_once_fails_on_a_sample_twice_a_missing_step_and_an_uncovered_epoch(tmp_path: Path) -> None:
    run = _run(tmp_path, groups=1)
    _samples(run, 0, {1: ["0:0", "0:1"], 2: ["0:1", "0:2"], 3: ["0:4", "0:5"]})
    verdict = inv.exactly_once(run, num_samples=6, twin=None)
    assert not verdict["ok"] and "1 sample(s) consumed twice, e.g. ['0:1']" in verdict["reason"]
    _samples(run, 0, {1: ["0:0", "0:1"], 3: ["0:4", "0:5"]})
    assert inv.exactly_once(run, 6, None) == inv.result(False, "steps with no committed samples: [2]")
    # Epoch 0 skipped sample 0:3 and the run went on into epoch 1.
    _samples(run, 0, {1: ["0:0", "0:1"], 2: ["0:2", "0:4"], 3: ["0:5", "1:0"]})
    verdict = inv.exactly_once(run, num_samples=6, twin=None)
    assert not verdict["ok"] and "complete epochs not fully covered" in verdict["reason"]
    assert "{0: 5}" in verdict["reason"]


def test_exactly_once_fails_when_a_step_ate_other_samples_than_the_twin(tmp_path: Path) -> None:
    run, twin = _run(tmp_path / "a", groups=1), _run(tmp_path / "b", groups=1)
    _samples(run, 0, {1: ["0:0", "0:1"], 2: ["0:2", "0:3"], 3: ["0:4", "0:5"]})
    _samples(twin, 0, {1: ["0:0", "0:1"], 2: ["0:4", "0:5"], 3: ["0:2", "0:3"]})
    assert inv.exactly_once(run, 6, None)["ok"]
    assert inv.exactly_once(run, 6, twin) == inv.result(False, "steps whose samples differ from the twin's: [2, 3]")


def test_replicas_identical_fails_on_a_differing_step_and_on_differing_finals(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _final(run, 0)
    _final(run, 1)
    _digests(run, 0, {1: "a" * 64, 2: "b" * 64, 3: "c" * 64})
    _digests(run, 1, {1: "a" * 64, 2: "x" * 64, 3: "c" * 64})
    verdict = inv.replicas_identical(run)
    assert not verdict["ok"] and "groups hold different parameters after step 2" in verdict["reason"]
    _digests(run, 1, {1: "a" * 64, 2: "b" * 64, 3: "c" * 64})
    assert inv.replicas_identical(run)["ok"]
    _final(run, 1, optim="z" * 64)
    verdict = inv.replicas_identical(run)
    assert not verdict["ok"] and "final optim_sha256 differs between groups" in verdict["reason"]


def test_replicas_identical_fails_when_it_compared_nothing(tmp_path: Path) -> None:
    """Equal finals but no per-step digest (the chaos hook did not load): not a pass."""
    run = _run(tmp_path)
    _final(run, 0)
    _final(run, 1)
    verdict = inv.replicas_identical(run)
    assert not verdict["ok"] and "no step has digests from two groups" in verdict["reason"], verdict
    _digests(run, 0, {1: "a" * 64, 2: "b" * 64, 3: "c" * 64})
    assert not inv.replicas_identical(run)["ok"], "one group's digests compare with nothing"
    single = _run(tmp_path / "one", groups=1)
    _final(single, 0)
    assert inv.replicas_identical(single)["ok"], "one group: nothing to compare is fine"


def test_twin_match_fails_without_finals_and_when_the_checkpoints_cannot_be_diffed(tmp_path: Path) -> None:
    run, twin = _run(tmp_path / "a", groups=1), _run(tmp_path / "b", groups=1)
    verdict, _ = inv.twin_match(run, twin, atol=1e-5)
    assert verdict == inv.result(False, "final.json missing in the run or in the twin")
    _final(run, 0)
    _final(twin, 0)
    assert inv.twin_match(run, twin, atol=1e-5)[0]["ok"], "bit-identical finals"
    # Finals differ and neither run has a checkpoint to diff: a failed invariant, not a crash.
    _final(run, 0, params="d" * 64)
    verdict, details = inv.twin_match(run, twin, atol=1e-5)
    assert not verdict["ok"] and f"step {STEPS} cannot be compared" in verdict["reason"], verdict
    assert details["steps_with_other_participants"] == []


def test_steps_lost_within_bound_fails_on_too_many_steps_a_failed_fault_and_a_wrong_restore() -> None:
    fault = {"kind": "kill_rank", "at_step": 5, "steps_lost": 1, "state": "done", "note": ""}
    assert inv.steps_lost_within_bound([fault], bound=1)["ok"]
    verdict = inv.steps_lost_within_bound([{**fault, "steps_lost": 3}], bound=1)
    assert verdict == inv.result(False, "faults that lost more than 1 steps: ['kill_rank@5: 3']")
    verdict = inv.steps_lost_within_bound([{**fault, "state": "failed", "note": "target not alive"}], bound=1)
    assert not verdict["ok"] and "could not be injected" in verdict["reason"]
    wrong = {**fault, "restore_check": {"ok": False, "reason": "got {'group0.rank0': 'persistent'}"}}
    verdict = inv.steps_lost_within_bound([wrong], bound=1)
    assert not verdict["ok"] and "did not restore from the expected source" in verdict["reason"]


def test_no_orphans_fails_on_a_leftover_process() -> None:
    assert inv.no_orphans([])["ok"]
    verdict = inv.no_orphans([{"pid": 4242, "cmdline": "python -m resilient.trainer"}])
    assert not verdict["ok"] and "1 process(es) of the job still alive" in verdict["reason"]


def test_slowed_rank_named_fails_on_a_missed_or_a_wrong_rank(tmp_path: Path) -> None:
    def named(*ranks: tuple[int, int]) -> inv.RunData:
        events = [{"event": "straggler", "group": g, "rank": r, "step": 10} for g, r in ranks]
        return _run(tmp_path, events=[*events, {"event": "straggler_cleared", "group": 0, "rank": 0, "step": 20}])

    assert inv.slowed_rank_named(named(), [])["ok"]  # no slow_rank fault: nothing to check
    assert inv.slowed_rank_named(named((1, 1)), [(1, 1)])["ok"]
    missed = inv.slowed_rank_named(named(), [(1, 1)])
    assert not missed["ok"] and "slowed but not named (group, rank): [(1, 1)]" in missed["reason"]
    waiter = inv.slowed_rank_named(named((1, 1), (1, 0)), [(1, 1)])
    assert not waiter["ok"] and waiter["reason"] == "named but not slowed: [(1, 0)]"
    whole = _run(tmp_path, events=[{"event": "straggler", "group": 1, "rank": None, "step": 10}])
    assert inv.slowed_rank_named(whole, [(1, 1)])["reason"].endswith("named but not slowed: [(1, -1)]")
