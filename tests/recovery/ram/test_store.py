"""The node-local snapshot store (``recovery/ram/store.py``): slots, indexes, checksums, cleanup."""

from __future__ import annotations

import os
import time

import pytest
import torch

from resilient.recovery.ram.store import RankStore, check_private_dir, clean_stale_stores, mark_store
from resilient.recovery.snapshot_format import first_corruption, tensor_view
from resilient.recovery.timeline import Timeline
from tests.recovery.ram.workers import write_snapshot

pytestmark = pytest.mark.timeout(120)


def test_store_keeps_the_newest_and_shows_only_complete_snapshots(tmp_path):
    store = RankStore(str(tmp_path / "own" / "rank0"), keep=2)
    for step in (2, 4, 6):
        write_snapshot(store, step, float(step))
    assert sorted(store.indexes()) == [4, 6]
    write_snapshot(store, 8, 8.0, publish=False)  # copied but never published: a worker killed mid-snapshot
    reopened = RankStore(store.directory, keep=2)
    assert sorted(reopened.indexes()) == [4, 6]
    index = reopened.indexes()[6]
    data = reopened.data(index)
    assert first_corruption(index, data) is None
    assert torch.equal(tensor_view(data, index.tensors[1]), torch.full((4,), 6.0).bfloat16())
    assert len([n for n in os.listdir(store.directory) if n.startswith("slot")]) <= 4  # keep + leased + 1


def test_store_never_reuses_a_leased_or_visible_slot(tmp_path):
    store = RankStore(str(tmp_path / "r"), keep=1)
    write_snapshot(store, 1, 1.0)
    visible = store.indexes()[1].slot
    leased = write_snapshot(store, 2, 2.0, publish=False)
    third, _ = store.reserve(16)
    assert len({visible, leased, third}) == 3


def test_corruption_is_detected_and_named(tmp_path):
    store = RankStore(str(tmp_path / "r"), keep=1)
    write_snapshot(store, 3, 3.0)
    index = store.indexes()[3]
    store.data(index)[index.tensors[1].offset + 1] ^= 0x40
    assert first_corruption(index, RankStore(store.directory, keep=1).data(index)) == "crc32c mismatch in tensor 'b'"


def test_stale_stores_of_dead_runs_are_removed_and_nothing_else(tmp_path):
    mine, dead, fresh, foreign = (tmp_path / n for n in ("mine", "dead", "fresh", "foreign"))
    for d in (mine, dead, fresh):
        mark_store(str(d))
    foreign.mkdir()
    old = time.time() - 7200
    os.utime(dead / "store.json", (old, old))
    os.utime(mine / "store.json", (old, old))
    removed = clean_stale_stores(str(tmp_path), str(mine), stale_after_s=3600)
    assert removed == [str(dead)]
    assert mine.exists() and fresh.exists() and foreign.exists() and not dead.exists()


def test_a_corrupt_index_is_skipped_and_named(tmp_path):
    store = RankStore(str(tmp_path / "r"), keep=2)
    write_snapshot(store, 1, 1.0)
    write_snapshot(store, 2, 2.0)
    path = tmp_path / "r" / "step-000000002.json"
    path.write_text(path.read_text().replace('"v": 2.0', '"v": 3.0'))  # the data cursor, say: still valid JSON
    assert sorted(store.indexes()) == [1]
    assert store.unreadable == ["step-000000002.json: index_crc32c mismatch: the index itself is corrupt"]


def test_store_directory_must_be_private(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="writable by no one else"):
        check_private_dir(str(shared))
    check_private_dir(str(tmp_path / "private"))
    assert (os.stat(tmp_path / "private").st_mode & 0o777) == 0o700


@pytest.mark.timeout(10)
def test_a_late_publish_of_an_older_timeline_never_evicts_the_current_one(tmp_path):
    old, new, other_run = ("run", "0-aa"), ("run", "1-bb"), ("gone", "4-cc")
    store = RankStore(str(tmp_path / "r"), keep=2)
    write_snapshot(store, 40, 40.0, tags=other_run)
    write_snapshot(store, 48, 48.0, tags=old)
    write_snapshot(store, 2, 2.0, tags=new)  # known abandoned: another run, an older incarnation
    write_snapshot(store, 4, 4.0, tags=new)
    assert sorted(store.indexes()) == [2, 4]
    # A snapshot of the older timeline still in flight across the restore publishes now. Before,
    # any other timeline counted as abandoned: it wiped steps 2 and 4 of the current one.
    write_snapshot(store, 50, 50.0, tags=old)
    assert {s: i.timeline for s, i in store.indexes().items()} == {2: "1-bb", 4: "1-bb", 50: "0-aa"}
    write_snapshot(store, 6, 6.0, tags=new)
    assert sorted(store.indexes()) == [4, 6]
    # Where the current timeline is known (the tier's), a late publish is itself dropped at once;
    # publishes of the current one drop every other timeline (a lost record restarts the
    # incarnation count, so a higher one can be of an abandoned history too).
    store.current = lambda: Timeline(run_id="run", incarnation=1, timeline="1-bb")
    write_snapshot(store, 52, 52.0, tags=old)
    assert sorted(store.indexes()) == [4, 6]
    write_snapshot(store, 60, 60.0, tags=("run", "7-dd"))
    write_snapshot(store, 8, 8.0, tags=new)
    assert {s: i.timeline for s, i in store.indexes().items()} == {6: "1-bb", 8: "1-bb"}
