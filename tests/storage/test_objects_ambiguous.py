"""Ambiguous answers from storage (issue 13, items 3 and 7): a create-if-absent that landed but whose
answer was lost counts as ours; a 409 is retried, not taken for "exists"; a per-key DeleteObjects
error raises, and a step's data is never deleted after its manifest failed to delete.

S3 cases talk HTTP to the session's moto server; the answers S3 gives but moto never does (409,
per-key delete errors) are injected at botocore's ``before-send`` hook, so they are parsed by
botocore exactly as real answers would be.
"""

from __future__ import annotations

import os
import re

import boto3
import pytest
from botocore.awsrequest import AWSResponse

from resilient.chaos.s3_proxy import FaultProxy
from resilient.errors import StorageError
from resilient.storage import s3 as s3_module
from resilient.storage.objects import FileObjectStore, MemoryObjectStore
from resilient.storage.retention import KeepLast, apply_retention
from resilient.storage.s3 import S3ObjectStore
from resilient.storage.url import parse_url

pytestmark = pytest.mark.timeout(60)

MANIFEST_KEY = "step-000000001/manifest.json"
OURS = b'{"step": 1, "attempt": "attempt-aaaa"}'
THEIRS = b'{"step": 1, "attempt": "attempt-bbbb"}'


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: object):  # noqa: ANN201 (what botocore's AWSResponse reads)
        yield self._body


def _answer(request, status: int, body: bytes) -> AWSResponse:
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


def _error_xml(code: str, message: str) -> bytes:
    return f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()


def _store(bucket: str, endpoint: str) -> S3ObjectStore:
    return S3ObjectStore(parse_url(f"s3://{bucket}/run", {"endpoint_url": endpoint}))


def test_s3_create_whose_answer_is_lost_counts_as_ours(s3_endpoint, s3_bucket) -> None:
    proxy = FaultProxy(s3_endpoint, seed=0)
    try:
        store = _store(s3_bucket, proxy.url)
        proxy.add_window("ambiguous", 30.0, keys="*/manifest.json", drops=1)
        # The PUT lands, its answer is dropped, botocore retries and meets our own manifest (412).
        assert store.write_if_absent(MANIFEST_KEY, OURS) is True
        assert proxy.counts["ambiguous"] == 1
        assert store.read(MANIFEST_KEY) == OURS
        # Another attempt's manifest is still refused: the commit point stays exclusive.
        assert store.write_if_absent(MANIFEST_KEY, THEIRS) is False
        assert store.read(MANIFEST_KEY) == OURS
    finally:
        proxy.close()


def test_s3_conflict_409_is_retried_not_taken_for_exists(s3_endpoint, s3_bucket, monkeypatch) -> None:
    monkeypatch.setattr(s3_module, "CONFLICT_BACKOFF_S", 0.01, raising=False)
    store = _store(s3_bucket, s3_endpoint)
    calls = []

    def conflict_twice(request, **_: object) -> AWSResponse | None:
        calls.append(request.url)
        if len(calls) <= 2:
            return _answer(request, 409, _error_xml("ConditionalRequestConflict", "a conditional write is in flight"))
        return None  # the third try goes to moto

    store._commit_client.meta.events.register("before-send.s3.PutObject", conflict_twice)
    assert store.write_if_absent(MANIFEST_KEY, OURS) is True
    assert len(calls) == 3 and store.read(MANIFEST_KEY) == OURS


def test_s3_conflict_that_never_clears_raises_naming_the_key(s3_endpoint, s3_bucket, monkeypatch) -> None:
    monkeypatch.setattr(s3_module, "CONFLICT_BACKOFF_S", 0.001, raising=False)
    monkeypatch.setattr(s3_module, "COMMIT_RETRY_WINDOW_S", 0.3, raising=False)
    store = _store(s3_bucket, s3_endpoint)

    def always_conflict(request, **_: object) -> AWSResponse:
        return _answer(request, 409, _error_xml("ConditionalRequestConflict", "a conditional write is in flight"))

    store._commit_client.meta.events.register("before-send.s3.PutObject", always_conflict)
    with pytest.raises(StorageError) as err:
        store.write_if_absent(MANIFEST_KEY, OURS)
    message = str(err.value)
    assert f"s3://{s3_bucket}/run/{MANIFEST_KEY}" in message
    assert "tries in" in message and "409 ConditionalRequestConflict" in message
    assert store.read(MANIFEST_KEY) is None


def _refuse_manifest_deletes(store: S3ObjectStore, endpoint: str) -> list[list[str]]:
    """DeleteObjects answers 200 with a per-key AccessDenied for every manifest.json; the other keys
    of the batch are really deleted (as S3 does). Returns the batches seen."""
    direct = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    batches: list[list[str]] = []

    def handler(request, **_: object) -> AWSResponse:
        keys = re.findall(r"<Key>(.*?)</Key>", request.body.decode() if isinstance(request.body, bytes) else "")
        batches.append(keys)
        errors = ""
        for key in keys:
            if key.endswith("/manifest.json"):
                errors += f"<Error><Key>{key}</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            else:
                direct.delete_object(Bucket=store.bucket, Key=key)
        body = f"<?xml version='1.0'?><DeleteResult>{errors}</DeleteResult>".encode()
        return _answer(request, 200, body)

    store._client.meta.events.register("before-send.s3.DeleteObjects", handler)
    return batches


def _committed_step(store: S3ObjectStore, step: int) -> list[str]:
    base = f"step-{step:09d}"
    keys = [f"{base}/attempt-{step}/w/zarr.json", f"{base}/attempt-{step}/w/0"]
    for key in keys:
        store.write(key, b"data")
    store.write(f"{base}/manifest.json", f'{{"step": {step}, "attempt": "attempt-{step}"}}'.encode())
    return keys


def test_s3_delete_error_raises_and_retention_keeps_the_steps_data(s3_endpoint, s3_bucket) -> None:
    store = _store(s3_bucket, s3_endpoint)
    old_data = _committed_step(store, 1)
    _committed_step(store, 2)
    batches = _refuse_manifest_deletes(store, s3_endpoint)
    with pytest.raises(StorageError) as err:
        apply_retention(store, KeepLast(1))
    message = str(err.value)
    assert f"s3://{s3_bucket}/run/step-000000001/manifest.json" in message and "AccessDenied" in message
    assert "still there" in message
    # The manifest could not go, so the step stays committed, and its data must still be there.
    assert store.exists("step-000000001/manifest.json")
    assert all(store.exists(k) for k in old_data)
    assert batches == [[f"run/{MANIFEST_KEY}"]]


def test_s3_delete_prefix_deletes_the_manifest_before_the_data(s3_endpoint, s3_bucket) -> None:
    store = _store(s3_bucket, s3_endpoint)
    data = _committed_step(store, 1)
    batches = _refuse_manifest_deletes(store, s3_endpoint)
    with pytest.raises(StorageError, match="AccessDenied"):
        store.delete_prefix("step-000000001")
    assert store.exists("step-000000001/manifest.json") and all(store.exists(k) for k in data)
    assert batches == [[f"run/{MANIFEST_KEY}"]], "the manifest goes alone, first"
    store._client = s3_module.s3_client(store.location)  # a client without the refusing hook
    store.delete_prefix("step-000000001")
    assert store.list_keys("step-000000001") == []


def test_file_link_that_landed_but_reported_eexist_counts_as_ours(tmp_path, monkeypatch) -> None:
    store = FileObjectStore(parse_url(str(tmp_path)))
    real_link = os.link

    def link_then_lose_the_reply(src: str, dst: str) -> None:
        # What an NFS client does when link()'s reply is lost: the retry finds the name taken.
        real_link(src, dst)
        raise FileExistsError(17, "File exists", dst)

    monkeypatch.setattr(os, "link", link_then_lose_the_reply)
    assert store.write_if_absent(MANIFEST_KEY, OURS) is True
    monkeypatch.setattr(os, "link", real_link)
    assert store.read(MANIFEST_KEY) == OURS
    assert os.listdir(tmp_path / "step-000000001") == ["manifest.json"], "no temp file left"
    assert store.write_if_absent(MANIFEST_KEY, THEIRS) is False
    assert store.write_if_absent(MANIFEST_KEY, OURS) is True, "another inode with our exact bytes is ours"
    assert store.read(MANIFEST_KEY) == OURS


def test_memory_create_of_our_own_bytes_counts_as_ours() -> None:
    store = MemoryObjectStore(parse_url("memory://ambiguous-test/run"))
    assert store.write_if_absent(MANIFEST_KEY, OURS) is True
    assert store.write_if_absent(MANIFEST_KEY, OURS) is True
    assert store.write_if_absent(MANIFEST_KEY, THEIRS) is False
    assert store.read(MANIFEST_KEY) == OURS


def test_the_manifest_write_on_s3_ends_before_the_other_ranks_give_up(s3_endpoint, s3_bucket) -> None:
    # The coordinator starts no manifest write after the agreed deadline; the others wait
    # decision_grace_s past it. A manifest write that could outlast that grace could commit a step
    # its peers already reported "not committed" (botocore's defaults allow 8 tries of 130 s).
    from resilient.storage.commit import decision_grace_s

    store = _store(s3_bucket, s3_endpoint)
    config = store._commit_client.meta.config
    assert config.retries["total_max_attempts"] == 1  # write_if_absent retries on its own clock
    per_call = config.connect_timeout + config.read_timeout
    assert per_call == s3_module.COMMIT_CALL_S and s3_module.COMMIT_WRITE_BOUND_S < 60
    for timeout_s in (10.0, 600.0, 86400.0):
        assert decision_grace_s(timeout_s, "s3") > s3_module.COMMIT_WRITE_BOUND_S
        assert decision_grace_s(timeout_s, "file") >= max(timeout_s, 600.0)


def test_s3_manifest_write_rides_out_throttling_within_its_bound(s3_endpoint, s3_bucket) -> None:
    # The commit client makes one try per call: 503 SlowDown must be retried by write_if_absent.
    store = _store(s3_bucket, s3_endpoint)
    calls: list[str] = []

    def slow_down_twice(request, **_: object) -> AWSResponse | None:
        calls.append(request.url)
        if len(calls) <= 2:
            return _answer(request, 503, _error_xml("SlowDown", "Please reduce your request rate."))
        return None

    store._commit_client.meta.events.register("before-send.s3.PutObject", slow_down_twice)
    assert store.write_if_absent(MANIFEST_KEY, OURS) is True
    assert len(calls) == 3 and store.read(MANIFEST_KEY) == OURS
