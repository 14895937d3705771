"""storage/notice.py: a failed save's notice through the job's rendezvous store. Read only after the
storage marker missed and at most once per poll cap; cleared once decided; a failed connect is
retried later, not remembered for the rest of the job."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from resilient.errors import CommitError
from resilient.manifest import Manifest
from resilient.storage import commit, notice
from resilient.storage.objects import FileObjectStore
from resilient.storage.persist import PersistJob
from resilient.storage.url import parse_url

pytestmark = pytest.mark.timeout(30)


class FakeKV:
    """The TCPStore client calls the notices make."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key].encode()

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class EmptyStore:
    """Storage in which no receipt, marker nor manifest ever lands (until the test puts one)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.location = SimpleNamespace(scheme="file", url="file:///run")

    def read(self, key: str) -> bytes | None:
        return self.data.get(key)

    def list_children(self, key: str) -> list[str]:
        return []


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """``notice._connect`` answers from this list, in turn (the last answer repeats)."""
    answers: list[object] = []

    def connect() -> object:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    monkeypatch.setattr(notice, "_connect", connect)
    monkeypatch.setattr(notice, "_client", {"store": None, "retry_at": 0.0})
    monkeypatch.setattr(notice, "_decisions", [])
    yield answers


def test_a_failed_connect_is_retried_later_not_forever_none(
    client: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = FakeKV()
    client.extend([None, kv])
    now = [1000.0]
    monkeypatch.setattr(notice.time, "monotonic", lambda: now[0])
    assert notice.read("step-1/a", "rank") is None  # the store is unreachable
    notice.post("step-1/a", "rank", {"rank": 1, "error": "disk full"})
    assert kv.data == {}  # not retried at once: a poll must not pay a connect timeout each time
    now[0] += notice.RETRY_CONNECT_S + 1
    notice.post("step-1/a", "rank", {"rank": 1, "error": "disk full"})
    assert notice.read("step-1/a", "rank") == {"rank": 1, "error": "disk full"}


def test_the_coordinator_reads_the_notice_at_most_once_per_poll_cap(
    client: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    client.append(FakeKV())
    reads: list[str] = []
    real_read = notice.read
    monkeypatch.setattr(notice, "read", lambda key, who: reads.append(who) or real_read(key, who))
    job = PersistJob(step=1, attempt="a", rank=0, world_size=2, plans={}, regions=[], commit_timeout_s=1.0)
    job.poll_cap_s = 0.3
    with pytest.raises(CommitError, match="no receipt from rank"):
        commit.wait_for_receipts(EmptyStore(), job)
    assert 1 <= len(reads) <= 5, reads  # each poll (about 12 in 1 s) read it before


def test_a_waiting_rank_reads_the_decision_notice_at_most_once_per_poll_cap(
    client: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    client.append(FakeKV())
    reads: list[str] = []
    monkeypatch.setattr(notice, "read", lambda key, who: reads.append(who))
    store = EmptyStore()
    job = PersistJob(step=1, attempt="a", rank=1, world_size=2, plans={}, regions=[], commit_timeout_s=20.0)
    job.poll_cap_s = 0.3
    manifest = Manifest(step=1, attempt="a", world_size=2, arrays={}, values={})
    timer = threading.Timer(1.0, lambda: store.data.__setitem__("step-000000001/manifest.json", manifest.dumps()))
    timer.start()
    commit.wait_for_commit(job, store)
    timer.join()
    assert reads and set(reads) == {"decision"} and len(reads) <= 5, reads


def test_the_coordinator_clears_the_rank_notice_once_it_decided(client: list[object], tmp_path: Path) -> None:
    kv = FakeKV()
    client.append(kv)
    job = PersistJob(step=3, attempt="a", rank=0, world_size=2, plans={}, regions=[])
    commit.write_failure(FileObjectStore(parse_url(str(tmp_path))), job.attempt_key, 1, OSError(28, "No space"))
    assert notice.read(job.attempt_key, "rank") is not None
    commit.decide_failed(FileObjectStore(parse_url(str(tmp_path))), job, OSError(28, "No space"))
    assert notice.read(job.attempt_key, "rank") is None
    assert "No space" in (notice.read(job.attempt_key, "decision") or {}).get("error", "")


def test_the_coordinator_clears_its_decision_notices_once_every_rank_is_past_them(
    client: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = FakeKV()
    client.append(kv)
    notice.post("step-000000003/a", "decision", {"rank": 0, "error": "disk full"})
    assert notice.read("step-000000003/a", "decision") is not None
    # The next attempt: every rank's receipt is in, so no rank still waits for the old decision.
    store = EmptyStore()
    store.list_children = lambda key: ["rank-00000.json", "rank-00001.json"]  # type: ignore[method-assign]
    store.read = lambda key: b'{"regions": []}'  # type: ignore[method-assign]
    job = PersistJob(step=4, attempt="b", rank=0, world_size=2, plans={}, regions=[])
    monkeypatch.setattr(commit, "check_coverage", lambda *args: None)
    monkeypatch.setattr(commit, "fault_point", lambda name: (_ for _ in ()).throw(RuntimeError("stop here")))
    with pytest.raises(RuntimeError, match="stop here"):
        commit._commit(job, store)
    assert kv.data == {}
