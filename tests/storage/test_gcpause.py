"""``gc_paused`` holds the collector off across nested and concurrent phases and gives back the
state it found; ``latest`` is advisory: written without fsync, and any reader takes a torn one."""

from __future__ import annotations

import gc
import json
import os
import threading

import pytest
import torch

from resilient import Checkpointer
from resilient.storage.gcpause import gc_paused

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_pauses_nest_across_threads_and_restore_the_collector(collector_on):
    inside, leave = threading.Event(), threading.Event()

    def other_phase() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    with gc_paused():
        assert not gc.isenabled()
        thread = threading.Thread(target=other_phase)
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's phase still runs
    leave.set()
    thread.join(10)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a phase that fails still gives the collector back")
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off(collector_on):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_save_and_a_load_leave_the_collector_on(tmp_path, collector_on):
    state = {f"n{i}": torch.full((8,), float(i)) for i in range(50)}
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
        back = {k: torch.zeros(8) for k in state}
        ckpt.load(back)
    assert gc.isenabled()
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_latest_is_written_without_fsync_and_a_torn_one_is_taken(tmp_path, monkeypatch):
    from resilient.storage.offline.catalog import read_latest

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait()
        assert json.loads((tmp_path / "latest").read_text()) == {"step": 1}
        assert synced and not [p for p in synced if p.endswith("/latest") or "/latest.tmp-" in p]
        (tmp_path / "latest").write_bytes(b"")  # what a crash may leave of an unsynced write
        assert read_latest(ckpt.store) is None
        ckpt.save(2, {"w": torch.ones(4)}).wait()
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 2}


def _blocking(real, inside: threading.Event, leave: threading.Event):
    """``real`` after it has told the test it is in and waited to be let go (a slow upload)."""

    def slow(*args, **kwargs):
        inside.set()
        assert leave.wait(30)
        return real(*args, **kwargs)

    return slow


@pytest.mark.parametrize("where", ["persist.write_packs", "commit.commit_manifest"])
def test_the_collector_runs_while_a_save_waits_on_storage(tmp_path, collector_on, monkeypatch, where):
    """The pause covers a save's CPU work, never its I/O: a save on the writer thread that waits
    on a slow upload (the packs, the manifest's conditional PUT) leaves the training thread's
    collector on."""
    import resilient.storage.commit as commit
    import resilient.storage.persist as persist

    module, name = {"persist": persist, "commit": commit}[where.split(".")[0]], where.split(".")[1]
    inside, leave = threading.Event(), threading.Event()
    monkeypatch.setattr(module, name, _blocking(getattr(module, name), inside, leave))
    state = {f"n{i}": torch.full((8,), float(i)) for i in range(50)}
    with Checkpointer(str(tmp_path)) as ckpt:
        handle = ckpt.save(1, state)
        try:
            assert inside.wait(30), f"the save never reached {where}"
            enabled_during_io = gc.isenabled()  # read on this (the training) thread
        finally:
            leave.set()
        handle.wait()
        assert ckpt.load({k: torch.zeros(8) for k in state}) == 1
    assert enabled_during_io, f"the collector was off while the save waited in {where}"
    assert gc.isenabled()
