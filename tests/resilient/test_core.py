"""The core helpers every layer shares: validate, runfiles, error payloads, dist.agree, state_digest."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from resilient import runfiles
from resilient.dist import agree, all_gather_json, broadcast_json, free_port
from resilient.errors import CommitError, ConfigError, RemoteError, ResilientError, from_payload, to_payload
from resilient.state import state_digest
from resilient.validate import check_bool, check_choice, check_int, check_number
from tests.dist import run_world

pytestmark = pytest.mark.timeout(120)


def test_validators_name_the_key_and_the_range() -> None:
    assert check_int("run.steps", 5, 1) == 5
    with pytest.raises(ConfigError, match=r"run\.steps=0 is out of range: allowed >= 1"):
        check_int("run.steps", 0, 1)
    with pytest.raises(ConfigError, match=r"run\.steps=True must be an integer"):
        check_int("run.steps", True, 1)
    with pytest.raises(ConfigError, match=r"optim\.lr=0 is out of range: allowed \(0, 1\]"):
        check_number("optim.lr", 0, 0, 1, open_low=True)
    with pytest.raises(ConfigError, match=r"x=nan must be a finite number"):
        check_number("x", float("nan"), 0, 1)
    with pytest.raises(ConfigError, match=r"checkpoint\.if_busy='later' must be one of 'wait', 'skip'"):
        check_choice("checkpoint.if_busy", "later", ("wait", "skip"))
    with pytest.raises(ConfigError, match=r"data\.log_samples=1 must be true or false"):
        check_bool("data.log_samples", 1)
    assert check_int("staging_bytes", np.int64(4096), 1) == 4096, "numpy integers are integers"
    assert type(check_int("staging_bytes", np.int64(4096), 1)) is int


def test_jsonl_under_a_file_reads_as_missing(tmp_path) -> None:
    # run.dir=/etc/passwd/x: the launcher reads the run's events after its ranks failed to start.
    (tmp_path / "a-file").write_text("")
    assert runfiles.read_jsonl(str(tmp_path / "a-file" / "run" / "events.jsonl")) == []


def test_jsonl_append_and_torn_last_line(tmp_path) -> None:
    path = str(tmp_path / "group0" / runfiles.METRICS_FILE)
    runfiles.append_jsonl(path, {"step": 1, "loss": 2.0})
    runfiles.append_jsonl(path, {"step": 2, "loss": 1.5})
    runfiles.append_jsonl(path, {"step": 1, "loss": 1.9})  # step 1 redone after a restore
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # a writer killed mid-line
    assert [r["step"] for r in runfiles.read_jsonl(path)] == [1, 2, 1]
    assert runfiles.read_jsonl_by_step(path) == {1: {"step": 1, "loss": 1.9}, 2: {"step": 2, "loss": 1.5}}
    assert runfiles.read_jsonl(str(tmp_path / "missing.jsonl")) == []
    tail = runfiles.JsonlTail(path)
    assert len(tail.poll()) == 3
    with open(path, "a") as f:
        f.write('ss": 1}\n')
    assert tail.poll() == [{"step": 3, "loss": 1}], "a line still being written waits for its newline"


def test_event_log_pid_files_and_paths(tmp_path, monkeypatch) -> None:
    run_dir = str(tmp_path)
    log = runfiles.EventLog(run_dir, enabled=True)
    log.write("start", group=0)
    log.close()
    runfiles.EventLog(run_dir, enabled=False).write("never")
    runfiles.write_event(run_dir, "done", step=7)
    assert [(e["event"], e.get("step")) for e in runfiles.read_events(run_dir)] == [("start", None), ("done", 7)]
    runfiles.write_pid(run_dir, 1, 0)
    assert runfiles.read_pid(run_dir, 1, 0) == os.getpid()
    assert runfiles.read_pid(run_dir, 1, 1) is None
    monkeypatch.setenv(runfiles.GROUP_ENV, "3")
    assert runfiles.group_file(run_dir, runfiles.SAVES_FILE) == os.path.join(run_dir, "group3", "saves.jsonl")
    monkeypatch.setenv(runfiles.GROUP_ENV, "x")
    with pytest.raises(ConfigError, match="RESILIENT_GROUP='x'"):
        runfiles.group_id()


def test_error_payload_keeps_class_message_and_remote_traceback() -> None:
    try:
        raise CommitError("step 4 not committed")
    except CommitError as e:
        payload = to_payload(e)
    err = from_payload(payload, prefix="[rank 1] ")
    assert type(err) is CommitError and str(err) == "[rank 1] step 4 not committed"
    assert isinstance(err.__cause__, RemoteError) and "test_error_payload_keeps" in str(err.__cause__)
    unknown = from_payload({"type": "ZeroDivisionError", "message": "division by zero", "traceback": ""})
    assert type(unknown) is ResilientError and str(unknown) == "ZeroDivisionError: division by zero"
    assert type(from_payload(to_payload(KeyError("model.w")))) is KeyError

    users_commit_error = type("CommitError", (Exception,), {})  # a user's class of our name is not ours
    assert type(from_payload(to_payload(users_commit_error("x")))) is ResilientError


def _agree_worker(rank: int, world: int) -> dict:
    out: dict = {}
    out["gathered"] = all_gather_json({"rank": rank, "pair": (rank, "x" * rank * 1000)})
    out["broadcast"] = broadcast_json({"from": rank} if rank == 1 else None, src=1)
    out["all"] = agree(lambda: rank * 10)
    out["one"] = agree(lambda: {"steps": [1, 2]} if rank == 0 else 1 / 0, src=0)

    def fails_on_rank_1() -> int:
        if rank == 1:
            raise CommitError("disk full on rank 1")
        return rank

    try:
        agree(fails_on_rank_1, what="save step 3")
    except CommitError as e:
        out["error"] = (type(e).__name__, str(e), type(e.__cause__).__name__)
    try:
        agree(lambda: (_ for _ in ()).throw(ValueError(f"bad on {rank}")))
    except ValueError as e:
        out["both"] = str(e)
    # A result JSON cannot hold is that rank's error, shared: no rank is left in the collective.
    try:
        agree(lambda: {1, 2} if rank == 1 else [1])
    except TypeError as e:
        out["set"] = str(e)
    try:
        agree(lambda: {(1, 2): 3}, src=0)
    except TypeError as e:
        out["tuple_key"] = str(e)
    return out


@pytest.mark.dist
def test_agree_raises_the_same_error_on_every_rank() -> None:
    results = run_world(_agree_worker, 2, timeout_s=90)
    for rank, out in enumerate(results):
        assert out["gathered"] == [{"rank": 0, "pair": [0, ""]}, {"rank": 1, "pair": [1, "x" * 1000]}]
        assert out["broadcast"] == {"from": 1}
        assert out["all"] == [0, 10]
        assert out["one"] == {"steps": [1, 2]}, "only src runs fn: rank 1's 1/0 never ran"
        assert out["error"][:2] == ("CommitError", "save step 3: [rank 1] disk full on rank 1")
        assert out["error"][2] == ("CommitError" if rank == 1 else "RemoteError")
        assert out["both"] == "[rank 0 (and 1 other rank(s))] bad on 0"
        assert out["set"].startswith("[rank 1] Object of type set is not JSON serializable")
        assert out["tuple_key"].startswith("[rank 0] keys must be str")


def test_agree_without_a_process_group() -> None:
    assert agree(lambda: 5) == [5]
    assert agree(lambda: 5, src=0) == 5
    with pytest.raises(ConfigError, match=r"^\[rank 0\] nope$"):
        agree(lambda: (_ for _ in ()).throw(ConfigError("nope")))
    assert 1024 <= free_port() <= 65535
    with pytest.raises(TypeError, match=r"^\[rank 0\] Object of type set"):
        agree(lambda: {1})


def test_state_digest_depends_on_bits_and_names() -> None:
    a = {"model": {"w": torch.arange(4.0), "b": torch.zeros(2)}, "step": 3}
    same = {"step": 9, "model": {"b": torch.zeros(2), "w": torch.arange(4.0)}}
    assert state_digest(a) == state_digest(same), "key order and JSON leaves do not count"
    flipped = {"model": {"w": torch.arange(4.0), "b": torch.tensor([0.0, -0.0])}}
    assert state_digest(a) != state_digest(flipped), "-0.0 differs from 0.0 in bits"
    renamed = {"model": {"w": torch.arange(4.0), "c": torch.zeros(2)}}
    assert state_digest(a) != state_digest(renamed)


@pytest.mark.timeout(10)
def test_an_unwritable_event_log_never_raises_and_is_warned_once(tmp_path, caplog) -> None:
    # Rank 0 alone writes restore_fallback between collectives: an OSError (ENOSPC, EROFS) raised
    # there left its peers waiting in the next one.
    (tmp_path / runfiles.EVENTS_FILE).mkdir()  # opening it for append fails (IsADirectoryError)
    runfiles.write_event(str(tmp_path), "restore_fallback", step=4)
    runfiles.write_event(str(tmp_path), "restore", step=2)
    log = runfiles.EventLog(str(tmp_path), enabled=True)
    log.write("done", step=2)
    log.close()
    warned = [r.getMessage() for r in caplog.records if "the run goes on without them" in r.getMessage()]
    assert len(warned) == 1 and runfiles.events_path(str(tmp_path)) in warned[0], warned
    assert list((tmp_path / runfiles.EVENTS_FILE).iterdir()) == []


def _stage_digests(rank: int, world: int) -> dict:
    # Rank 0 holds "a", rank 1 holds "b" (two pipeline stages); "b" changes when asked.
    group = torch.distributed.group.WORLD
    held = {"a": torch.arange(4.0)} if rank == 0 else {"b": torch.ones(3)}
    changed = {"a": torch.arange(4.0)} if rank == 0 else {"b": torch.zeros(3)}
    return {"held": state_digest(held, group=group), "changed": state_digest(changed, group=group)}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_state_digest_over_a_group_covers_every_rank_s_tensors() -> None:
    results = run_world(_stage_digests, 2, timeout_s=90)
    assert results[0] == results[1], "every rank of the group gets the same digest"
    whole = state_digest({"a": torch.arange(4.0), "b": torch.ones(3)})
    assert results[0]["held"] == whole, "split over two ranks = the same tensors in one process"
    assert results[0]["changed"] != results[0]["held"], "a change on rank 1 alone changes rank 0's digest"


def test_metrics_sink_records_carry_time_run_id_and_incarnation(tmp_path) -> None:
    """saves.jsonl / ram.jsonl are joined with the other run files by run_id and incarnation."""
    from resilient.metrics import JsonlSink

    path = str(tmp_path / "group0" / runfiles.SAVES_FILE)
    sink = JsonlSink(path)
    try:
        runfiles.stamp_records(run_id="r1", incarnation=3)
        sink.write({"event": "save", "step": 7})
    finally:
        runfiles._identity.clear()
    (record,) = runfiles.read_jsonl(path)
    assert (record["run_id"], record["incarnation"], record["step"]) == ("r1", 3, 7)
    assert record["t"] > 1e9
    assert list(sink.records) == [{"event": "save", "step": 7}]
