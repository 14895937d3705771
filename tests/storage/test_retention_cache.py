"""Retention's requests per commit stay bounded as kept steps pile up, and what it remembers about
committed steps never makes it delete what it would not delete from a fresh look."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import pytest
import torch

from resilient import Checkpointer
from resilient.manifest import MANIFEST, Manifest, step_dir
from resilient.storage import retention_cache
from resilient.storage.commit import commit_manifest
from resilient.storage.objects import FileObjectStore, open_store
from resilient.storage.retention import KeepLast, apply_retention, new_attempt, plan_retention, set_aside
from resilient.storage.url import parse_url

pytestmark = [pytest.mark.timeout(120)]

COMMITS = 20


def _count_file_requests(monkeypatch) -> dict[str, int]:
    """Every FileObjectStore call of this process, the way an object store would bill them."""
    counts = {"requests": 0}
    for name in ("read", "write", "write_unsynced", "write_if_absent", "exists", "list_children", "list_keys"):
        real = getattr(FileObjectStore, name)

        def counted(self, *args, _real=real, **kwargs):
            counts["requests"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(FileObjectStore, name, counted)
    return counts


def _count_s3_requests(ckpt: Checkpointer) -> dict[str, int]:
    """Every S3 API call of the checkpointer's object store (both of its clients)."""
    counts = {"requests": 0}

    def count(**_kwargs) -> None:
        counts["requests"] += 1

    for client in (ckpt.store._client, ckpt.store._commit_client):
        client.meta.events.register("before-call.s3", count)
    return counts


def _requests_per_commit(ckpt: Checkpointer, counts: dict[str, int], steps: range) -> list[int]:
    per_commit = []
    for step in steps:
        before = counts["requests"]
        ckpt.save(step, {"w": torch.full((8,), float(step))}).wait()
        per_commit.append(counts["requests"] - before)
    return per_commit


def _assert_bounded(per_commit: list[int]) -> None:
    # Every kept step looked at again would cost a HEAD, two GETs and a LIST per commit: the late
    # commits must cost what the early ones do.
    early, late = per_commit[2:5], per_commit[-5:]
    assert max(late) <= max(early) + 2, per_commit


def test_requests_per_commit_stay_bounded_on_disk_with_every_step_kept(tmp_path, monkeypatch):
    counts = _count_file_requests(monkeypatch)
    with Checkpointer(str(tmp_path)) as ckpt:  # keep_last unset: every step kept
        per_commit = _requests_per_commit(ckpt, counts, range(1, COMMITS + 1))
        assert ckpt.steps() == list(range(1, COMMITS + 1))
    _assert_bounded(per_commit)


def test_requests_per_commit_stay_bounded_on_s3_with_every_step_kept(s3_endpoint, s3_bucket):
    with Checkpointer(f"s3://{s3_bucket}/run") as ckpt:
        counts = _count_s3_requests(ckpt)
        per_commit = _requests_per_commit(ckpt, counts, range(1, COMMITS + 1))
        assert ckpt.steps() == list(range(1, COMMITS + 1))
    _assert_bounded(per_commit)
    assert max(per_commit[-5:]) <= 20, per_commit  # the save's own objects, and retention's few


@contextmanager
def _another_process():
    """Code run inside is another process of the run as far as retention's memory goes (it is per
    process): a writer that never saw what this one learned, and whose passes teach this one nothing."""
    saved = retention_cache._BY_ROOT
    retention_cache._BY_ROOT = {}
    try:
        yield
    finally:
        retention_cache._BY_ROOT = saved


def _attempt_dir(root, step: int) -> str:
    return json.loads((root / step_dir(step) / MANIFEST).read_bytes())["attempt"]


def _old_attempt() -> str:
    return f"attempt-{int((time.time() - 3600) * 1000):011x}-0badc0de"  # a writer killed an hour ago


def _state(value: float) -> dict:
    return {"w": torch.full((8,), float(value))}


def test_what_another_writer_changed_in_settled_steps_is_never_deleted(tmp_path):
    """Writer A settled steps 1-6; another process then sets step 3 aside and commits it afresh,
    starts saving step 4 again (a young attempt), and a killed writer leaves an old attempt in
    step 2. A's later commits keep the new commit, the set-aside data and the save in flight, every
    step still loads, and the dead attempt goes within as many commits as there are kept steps."""
    with Checkpointer(str(tmp_path)) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, _state(step)).wait()
        first_of_3 = _attempt_dir(tmp_path, 3)
        assert len(retention_cache.checked_steps(ckpt.store.location.url)) == 6
        with _another_process(), Checkpointer(str(tmp_path)) as other:
            manifest = (tmp_path / step_dir(3) / MANIFEST).read_bytes()
            assert set_aside(other.store, 3, manifest)
            other.save(3, _state(33.0)).wait()
        second_of_3 = _attempt_dir(tmp_path, 3)
        in_flight, dead = new_attempt(), _old_attempt()
        for step, attempt in ((4, in_flight), (2, dead)):
            ckpt.store.write(f"{step_dir(step)}/{attempt}/w/c/0", b"x")
        for step in range(7, 7 + 8):  # 8 commits: every kept step looked at again at least once
            ckpt.save(step, _state(step)).wait()
            assert (tmp_path / step_dir(3) / first_of_3).is_dir()  # set aside: kept for inspection
            assert (tmp_path / step_dir(3) / second_of_3).is_dir()  # the fresh commit
            assert (tmp_path / step_dir(4) / in_flight).is_dir()  # another writer's save in flight
        assert not (tmp_path / step_dir(2) / dead).exists()  # before the cache: gone after step 7
        assert ckpt.steps() == list(range(1, 15))
        for step in range(1, 15):
            target = _state(0.0)
            assert ckpt.load(target, step=step) == step
            assert torch.equal(target["w"], torch.full((8,), 33.0 if step == 3 else float(step)))


def test_a_resumed_run_looks_at_every_step_once_then_costs_a_bounded_number(tmp_path, monkeypatch):
    """A new process knows nothing: its first commit looks at every kept step (and deletes what a
    killed writer of the last run left), the commits after it are back to a bounded cost."""
    with _another_process(), Checkpointer(str(tmp_path)) as first_run:
        for step in range(1, 11):
            first_run.save(step, _state(step)).wait()
    dead = _old_attempt()
    open_store(parse_url(str(tmp_path))).write(f"{step_dir(5)}/{dead}/w/c/0", b"x")
    counts = _count_file_requests(monkeypatch)
    with _another_process(), Checkpointer(str(tmp_path)) as resumed:
        per_commit = _requests_per_commit(resumed, counts, range(11, 17))
        assert resumed.steps() == list(range(1, 17))
    assert not (tmp_path / step_dir(5) / dead).exists()
    assert per_commit[0] >= 3 * 10 and max(per_commit[1:]) <= 15, per_commit


def test_keep_last_still_reads_the_manifests_it_counts(tmp_path):
    """keep_last counts steps that load: a manifest damaged after a pass settled its step is read
    again (its bytes differ), not counted, and does not crowd out the older good step."""
    with Checkpointer(str(tmp_path), keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).wait()
        assert ckpt.steps() == [2, 3]
        path = tmp_path / step_dir(3) / MANIFEST
        path.write_bytes(b"x" * len(path.read_bytes()))
        ckpt.save(4, _state(4)).wait()
        # Steps 4 and 2 are the two that load; damaged 3 is kept but not counted.
        assert sorted(os.listdir(tmp_path)) == ["latest", step_dir(2), step_dir(3), step_dir(4)]


def test_entries_of_steps_another_writer_deleted_go_with_the_listing(tmp_path):
    # keep_last=1 run by another process deletes what A settled; A's entries for them go with the listing.
    root = str(tmp_path)
    with Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).wait()
        known = retention_cache.checked_steps(ckpt.store.location.url)
        with _another_process():
            apply_retention(open_store(parse_url(root)), KeepLast(1), known=retention_cache.checked_steps(root))
        assert ckpt.steps() == [3]
        ckpt.save(4, _state(4)).wait()
        assert len(known) == 2 and ckpt.steps() == [3, 4]


def test_a_step_another_process_set_aside_is_asked_about_before_it_is_deleted(tmp_path):
    """keep_last=2: A settled step 2; another process sets it aside (a restore fell back past it)
    and saves step 2 again. A's next commit puts step 2 beyond keep_last, but it is no longer
    committed: deleting it whole, as A's memory says, would take the save in flight with it."""
    with Checkpointer(str(tmp_path), keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).wait()
        with _another_process():
            manifest = (tmp_path / step_dir(2) / MANIFEST).read_bytes()
            assert set_aside(open_store(parse_url(str(tmp_path))), 2, manifest)
        in_flight = new_attempt()
        ckpt.store.write(f"{step_dir(2)}/{in_flight}/w/c/0", b"x")
        for step in (4, 5):
            ckpt.save(step, _state(step)).wait()
            assert (tmp_path / step_dir(2) / in_flight).is_dir()
        assert ckpt.steps() == [4, 5]


def _committed_root(tmp_path, steps: range):
    store = open_store(parse_url(str(tmp_path)))
    for step in steps:
        attempt = new_attempt()
        store.write(f"{step_dir(step)}/{attempt}/w/c/0", b"x")
        commit_manifest(store, Manifest(step=step, attempt=attempt, world_size=1, arrays={}, values={}))
    return store


def test_a_pass_whose_deletes_failed_settles_nothing(tmp_path):
    store = _committed_root(tmp_path, range(1, 4))
    dead = _old_attempt()
    store.write(f"{step_dir(2)}/{dead}/w/c/0", b"x")
    known = retention_cache.CheckedSteps()

    class FailingDeletes:
        def __getattr__(self, name):
            return getattr(store, name)

        def delete_prefix(self, key: str) -> None:
            raise OSError("injected: delete refused")

    with pytest.raises(OSError, match="injected"):
        apply_retention(FailingDeletes(), KeepLast(None), young_s=60.0, known=known)
    assert len(known) == 0  # step 2 is not settled: its stray is still there
    assert apply_retention(store, KeepLast(None), young_s=60.0, known=known) == [f"{step_dir(2)}/{dead}"]
    assert len(known) == 3 and apply_retention(store, KeepLast(None), young_s=60.0, known=known) == []


def test_a_pass_that_finds_another_pass_running_looks_at_every_step(tmp_path):
    store = _committed_root(tmp_path, range(1, 4))
    known = retention_cache.CheckedSteps()
    apply_retention(store, KeepLast(None), young_s=60.0, known=known)
    dead = _old_attempt()
    store.write(f"{step_dir(1)}/{dead}/w/c/0", b"x")
    with known.lock:  # another Checkpointer of this process is in its pass: no wait, no skipping
        assert apply_retention(store, KeepLast(None), young_s=60.0, known=known) == [f"{step_dir(1)}/{dead}"]


def test_an_uncommitted_step_below_a_newest_step_another_process_set_aside_stays(tmp_path):
    """A settled steps 100-300; another process sets 300 aside. An uncommitted step 250 is then above
    the newest committed step (200), where a save may be in flight: a fresh look leaves it, and so
    must a pass that remembers 300 as committed."""
    store = _committed_root(tmp_path, range(100, 301, 100))
    known = retention_cache.CheckedSteps()
    apply_retention(store, KeepLast(None), young_s=60.0, known=known)
    assert set_aside(store, 300, store.read(f"{step_dir(300)}/{MANIFEST}"))
    store.write(f"{step_dir(250)}/attempt-without-a-clock/w/c/0", b"x")  # no age to read: not known young
    assert plan_retention(store, KeepLast(None), young_s=60.0) == []
    assert plan_retention(store, KeepLast(None), young_s=60.0, known=known) == []
