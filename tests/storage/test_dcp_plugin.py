"""resilient.dcp in one process: dcp.save / dcp.load through our plugin and planners, what our
Checkpointer and tools read of it, and every refusal as one line naming what it refuses."""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from resilient import Checkpointer
from resilient.dcp import LoadPlanner, SavePlanner, StorageReader, StorageWriter
from resilient.errors import CommitError, IntegrityError, RestoreError, StorageError
from resilient.manifest import MANIFEST, step_dir
from resilient.tools.ckpt import main as ckpt_main

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _state(seed: int) -> dict:
    model, opt = _model(seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"epoch": 3, "tag": "run", "nested": {"a": [1, 2]}},
        "dataloader": b"\x00\x01state",
        "sampler": io.BytesIO(b"sampler-bytes"),
    }


def _blank() -> dict:
    state = _state(seed=99)
    state.update(extra={"epoch": 0, "tag": "", "nested": {"a": []}}, dataloader=b"", sampler=io.BytesIO())
    return state


def _tensors_equal(a: dict, b: dict) -> None:
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        elif isinstance(value, dict):
            _tensors_equal(value, b[key])


def test_our_planners_round_trip_every_value_without_pickle(tmp_path) -> None:
    url, saved = str(tmp_path / "ck"), _state(seed=0)
    dcp.save(saved, storage_writer=StorageWriter(url, step=5), planner=SavePlanner())
    got = _blank()
    dcp.load(got, storage_reader=StorageReader(url), planner=LoadPlanner())
    _tensors_equal(saved["model"], got["model"])
    _tensors_equal(saved["optim"]["state"], got["optim"]["state"])
    assert got["extra"] == {"epoch": 3, "tag": "run", "nested": {"a": [1, 2]}}
    assert got["dataloader"] == b"\x00\x01state" and got["sampler"].getvalue() == b"sampler-bytes"
    assert got["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again, as saved
    # The manifest holds the values as our Checkpointer stores them: a tensor-free dict whole.
    manifest = json.loads((tmp_path / "ck" / step_dir(5) / MANIFEST).read_bytes())
    assert manifest["values"]["extra"] == {"value": {"epoch": 3, "tag": "run", "nested": {"a": [1, 2]}}}
    assert manifest["values"]["optim.param_groups"]["value"][0]["lr"] == 0.01
    blobs = manifest["metadata"]["dcp"]["blobs"]
    assert {k: b["encoding"] for k, b in blobs.items()} == {"dataloader": "bytes", "sampler": "BytesIO"}


def test_checkpointer_and_tools_read_a_plugin_written_step(tmp_path, capsys) -> None:
    url, saved = str(tmp_path / "ck"), _state(seed=0)
    dcp.save(saved, storage_writer=StorageWriter(url, step=2), planner=SavePlanner())
    assert ckpt_main(["verify", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"][0]["tensors"] == 4 + 12
    assert ckpt_main(["convert", url, str(tmp_path / "st"), "--to", "safetensors"]) == 0
    got = _blank()
    del got["dataloader"], got["sampler"]  # the raw-bytes values are the plugin's own, not the Checkpointer's
    assert Checkpointer(url).load(got) == 2
    _tensors_equal(saved["optim"]["state"], got["optim"]["state"])
    assert got["extra"]["nested"] == {"a": [1, 2]} and got["optim"]["param_groups"][0]["eps"] == 1e-8


def test_a_converted_copy_names_the_byte_values_it_did_not_carry(tmp_path, capsys) -> None:
    url, saved = str(tmp_path / "ck"), _state(seed=0)
    dcp.save(saved, storage_writer=StorageWriter(url, step=2), planner=SavePlanner())
    assert ckpt_main(["convert", url, str(tmp_path / "copy"), "--to", "resilient"]) == 0
    got = _blank()
    with pytest.raises(CheckpointException, match="convert/reshard copy tensors and JSON values, not the values DCP"):
        dcp.load(got, storage_reader=StorageReader(str(tmp_path / "copy")), planner=LoadPlanner())
    del got["dataloader"], got["sampler"]
    dcp.load(got, storage_reader=StorageReader(str(tmp_path / "copy")), planner=LoadPlanner())
    _tensors_equal(saved["model"], got["model"])
    assert got["extra"] == saved["extra"]


def test_checkpointer_written_step_loads_through_dcp(tmp_path) -> None:
    url, saved = str(tmp_path / "ck"), _state(seed=0)
    del saved["dataloader"], saved["sampler"]
    Checkpointer(url).save(4, saved).wait()
    got = _blank()
    del got["dataloader"], got["sampler"]
    dcp.load(got, storage_reader=StorageReader(url, step=4), planner=LoadPlanner())
    _tensors_equal(saved, got)
    assert got["extra"] == saved["extra"] and got["optim"]["param_groups"][0]["lr"] == 0.01
    plain = _blank()
    del plain["dataloader"], plain["sampler"]
    dcp.load(plain, storage_reader=StorageReader(url))  # DCP's default planner: our own pickle of JSON
    assert plain["extra"] == saved["extra"]


def test_default_planner_values_are_marked_blobs_read_only_with_trust_pickle(tmp_path) -> None:
    url, saved = str(tmp_path / "ck"), _state(seed=0)
    dcp.save(saved, storage_writer=StorageWriter(url, step=1))  # DCP's default planner pickles values
    manifest = json.loads((tmp_path / "ck" / step_dir(1) / MANIFEST).read_bytes())
    assert {b["encoding"] for b in manifest["metadata"]["dcp"]["blobs"].values()} == {"torch.save"}
    got = _blank()
    with pytest.raises(BaseException, match=r"pickled by DCP's default planner \('dataloader', 'extra.epoch'"):
        dcp.load(got, storage_reader=StorageReader(url))
    with pytest.raises(BaseException, match="LoadPlanner never unpickles"):
        dcp.load(got, storage_reader=StorageReader(url, trust_pickle=True), planner=LoadPlanner())
    dcp.load(got, storage_reader=StorageReader(url, trust_pickle=True))
    _tensors_equal(saved, got)
    assert got["extra"] == saved["extra"] and got["dataloader"] == saved["dataloader"]
    # The Checkpointer reads the tensors and never the blobs.
    plain = {"model": _blank()["model"]}
    assert Checkpointer(url).load(plain, strict=False) == 1
    _tensors_equal(saved["model"], plain["model"])


def test_our_save_planner_refuses_an_unstorable_value_naming_its_key(tmp_path) -> None:
    state = {"w": torch.ones(3), "cfg": {"when": object()}}
    with pytest.raises(BaseException, match=r"'cfg.when' is a builtins.object"):
        dcp.save(state, storage_writer=StorageWriter(str(tmp_path / "ck"), step=1), planner=SavePlanner())
    assert not os.path.exists(tmp_path / "ck" / step_dir(1) / MANIFEST)


def test_a_dcp_written_step_is_the_objects_the_format_names(tmp_path) -> None:
    """The coordinator keeps its receipt in memory, as the Checkpointer's does (docs/format.md):
    a one-process step is its pack, its byte values and the manifest."""
    url = tmp_path / "ck"
    dcp.save(_state(seed=0), storage_writer=StorageWriter(str(url), step=2), planner=SavePlanner())
    step = url / step_dir(2)
    files = sorted(str(p.relative_to(step)).split("/", 1)[-1] for p in step.rglob("*") if p.is_file())
    assert files == ["dcp/values-rank-00000.bin", MANIFEST, "pack-r00000-0.zip"]
    assert Checkpointer(str(url)).steps() == [2]


def test_checkpoint_id_addresses_root_and_step_like_torchtitan(tmp_path) -> None:
    root, saved = str(tmp_path / "ckpt"), _state(seed=0)
    dcp.save(saved, checkpoint_id=f"{root}/step-10", storage_writer=StorageWriter(), planner=SavePlanner())
    dcp.save(saved, checkpoint_id=f"{root}/step-20", storage_writer=StorageWriter(keep_last=1), planner=SavePlanner())
    assert Checkpointer(root).steps() == [20]  # retention, as asked
    got = _blank()
    dcp.load(got, checkpoint_id=f"{root}/step-20", storage_reader=StorageReader(), planner=LoadPlanner())
    _tensors_equal(saved, got)
    assert StorageWriter.validate_checkpoint_id(f"{root}/step-20") and not StorageReader.validate_checkpoint_id(root)


def test_a_committed_step_is_never_overwritten(tmp_path) -> None:
    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(url, step=1))
    with pytest.raises(CommitError, match="^step 1 is already committed at .*; a step is written once"):
        StorageWriter(url, step=1)  # one line, before DCP would wrap it
    late = StorageWriter(url, step=2)
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=StorageWriter(url, step=2))
    with pytest.raises(CheckpointException, match="step 2 is already committed"):  # the coordinator checks again
        dcp.save({"w": torch.zeros(3)}, storage_writer=late)
    got = {"w": torch.empty(3)}
    dcp.load(got, storage_reader=StorageReader(url))
    assert torch.equal(got["w"], torch.full((3,), 2.0))


def test_corrupt_chunk_is_named_with_tensor_and_step(tmp_path) -> None:
    url = str(tmp_path / "ck")
    dcp.save({"layer": {"w": torch.arange(64.0)}}, storage_writer=StorageWriter(url, step=3))
    manifest = json.loads((tmp_path / "ck" / step_dir(3) / "manifest.json").read_text())
    pack, offset, _ = manifest["arrays"]["layer.w"]["shards"]["0"]  # where the shard lies in its pack
    path = tmp_path / "ck" / step_dir(3) / manifest["attempt"] / pack
    data = bytearray(path.read_bytes())
    data[offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match=r"IntegrityError: .*'layer\.w'.*step 3") as caught:
        dcp.load({"layer": {"w": torch.empty(64)}}, storage_reader=StorageReader(url))
    error = caught.value.failures[0][0]  # what the rank raised, with its class, under DCP's wrapper
    assert isinstance(error, IntegrityError) and "'layer.w'" in str(error) and "step 3" in str(error)


def test_missing_step_and_foreign_root_are_one_line(tmp_path) -> None:
    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(url, step=1))
    with pytest.raises(RestoreError, match=r"^step 7 is not committed under .*; committed steps: \[1\]$"):
        StorageReader(url, step=7)
    with pytest.raises(RestoreError, match=r"^step 7 is not committed under"):
        dcp.load({"w": torch.empty(3)}, checkpoint_id=f"{url}/step-7", storage_reader=StorageReader())
    theirs = str(tmp_path / "theirs")
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(theirs))
    with pytest.raises(RestoreError, match="is a checkpoint of DCP's own FileSystemWriter, not a resilient root"):
        StorageReader(theirs)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RestoreError, match="^no committed resilient checkpoint under .*; nothing to load$"):
        StorageReader(str(tmp_path / "empty"))
    with pytest.raises(StorageError, match="does not exist"):
        StorageReader(str(tmp_path / "nowhere"))


def test_ranks_that_read_different_steps_are_refused(tmp_path) -> None:
    from torch.distributed.checkpoint.planner import LoadPlan

    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(url, step=1))
    reader = StorageReader(url)
    reader.read_metadata()
    plans = [LoadPlan([], storage_data=(1, "attempt-a")), LoadPlan([], storage_data=(2, "attempt-b"))]
    with pytest.raises(RestoreError, match=r"the ranks read different steps of .*retry, or pass"):
        reader.prepare_global_plan(plans)
    assert reader.prepare_global_plan(plans[:1]) == plans[:1]
    assert reader.prepare_local_plan(LoadPlan([])).storage_data[0] == 1


def test_writer_and_reader_pickle_without_open_stores(tmp_path) -> None:
    url = str(tmp_path / "ck")
    writer = StorageWriter(url, step=1, keep_last=2)
    dcp.save({"w": torch.ones(3)}, storage_writer=writer)
    again = pickle.loads(pickle.dumps(writer))  # process-async sends the writer to its own process
    assert (again.url, again.step, again.keep_last) == (url, 1, 2)
    reader = StorageReader(url)
    dcp.load({"w": torch.empty(3)}, storage_reader=reader)
    assert pickle.loads(pickle.dumps(reader)).url == url


def test_s3_round_trip(s3_bucket) -> None:
    url, saved = f"s3://{s3_bucket}/dcp", _state(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, storage_writer=StorageWriter(url, step=1), planner=SavePlanner())
        got = _blank()
        dcp.load(got, storage_reader=StorageReader(url), planner=LoadPlanner())
    _tensors_equal(saved, got)
    assert got["extra"] == saved["extra"] and got["dataloader"] == saved["dataloader"]
    assert Checkpointer(url).steps() == [1]
