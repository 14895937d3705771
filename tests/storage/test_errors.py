"""Bad input: one clear error that says what and where, and nothing written."""

from __future__ import annotations

import os

import pytest
import torch

from resilient import Checkpointer, CommitError, ConfigError, RestoreError, StateError, StorageError

pytestmark = pytest.mark.timeout(60)


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_unsupported_url_and_bad_arguments():
    with pytest.raises(ConfigError, match="unsupported checkpoint URL 'gs://b/x'"):
        Checkpointer("gs://b/x")
    with pytest.raises(ConfigError, match="keep_last"):
        Checkpointer("/tmp/x", keep_last=-1)
    with pytest.raises(ConfigError, match="step must be a non-negative int"):
        Checkpointer("memory://e/x").save(-1, {})


def test_missing_directory_on_load_names_it_and_creates_nothing(tmp_path):
    root = tmp_path / "no" / "such"
    with pytest.raises(StorageError, match=f"checkpoint directory '{root}' does not exist"):
        Checkpointer(str(root)).load({"w": torch.zeros(2)})
    assert not (tmp_path / "no").exists()


def test_load_with_no_committed_step(tmp_path):
    with pytest.raises(RestoreError, match=f"no committed checkpoint under {tmp_path}"):
        Checkpointer(str(tmp_path)).load({"w": torch.zeros(2)})
    with pytest.raises(RestoreError, match="step 5 is not committed"):
        Checkpointer(str(tmp_path)).load({"w": torch.zeros(2)}, step=5)


def test_shape_mismatch_and_unknown_keys_listed_in_one_error(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"a": torch.ones(4, 4), "b": torch.ones(3), "gone": torch.ones(1), "n": 1}).wait()
    target = {"a": torch.zeros(4, 5), "b": torch.zeros(3), "new": torch.zeros(2), "n": 0}
    with pytest.raises(RestoreError) as info:
        ckpt.load(target)
    msg = str(info.value)
    assert "'a' shape: checkpoint [4, 4] vs state [4, 5]" in msg
    assert "'new'" in msg and "'gone'" in msg and "step 1" in msg
    assert torch.equal(target["b"], torch.zeros(3))  # nothing was loaded
    del target["a"]
    ckpt.load(target, strict=False)  # the matching subset only
    assert torch.equal(target["b"], torch.ones(3)) and target["n"] == 1 and torch.equal(target["new"], torch.zeros(2))


def test_dtype_mismatch_is_strict(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"a": torch.ones(4)}).wait()
    with pytest.raises(RestoreError, match="'a' dtype: checkpoint float32 vs state bfloat16"):
        ckpt.load({"a": torch.zeros(4, dtype=torch.bfloat16)})


def test_unstorable_leaf_is_named_and_nothing_written(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(StateError, match=r"'opt.sched' is a .*object.*neither a tensor nor JSON-able"):
        ckpt.save(1, {"w": torch.ones(2), "opt": {"sched": object()}})
    with pytest.raises(StateError, match="must not contain '/'"):
        ckpt.save(1, {"a/b": torch.ones(2)})
    assert not (tmp_path / "ck").exists()


def test_step_already_committed_is_refused_and_old_step_intact(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"w": torch.ones(2)}).wait()
    before = _files(tmp_path)
    with pytest.raises(CommitError, match="step 1 is already committed"):
        ckpt.save(1, {"w": torch.zeros(2)})
    assert _files(tmp_path) == before
    target = {"w": torch.zeros(2)}
    ckpt.load(target)
    assert torch.equal(target["w"], torch.ones(2))


def test_missing_bucket_names_it_and_creates_nothing(s3_endpoint):
    import boto3

    ckpt = Checkpointer("s3://no-such-bucket/run")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist at http://127.0.0.1"):
        ckpt.save(1, {"w": torch.ones(2)})
    with pytest.raises(StorageError, match="no-such-bucket"):
        ckpt.load({"w": torch.zeros(2)})
    buckets = boto3.client("s3", endpoint_url=s3_endpoint).list_buckets()["Buckets"]
    assert "no-such-bucket" not in [b["Name"] for b in buckets]
