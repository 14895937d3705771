"""Issue 13 item 7, the writers: staging buffers told apart by identity, never by ``id()``; a dead
writer process fails its saves through the agreed decision and is replaced for the next save.

No writer process is spawned here (a spawn costs seconds on a loaded 2-core machine); the real
process path is covered by ``test_async.py``'s ``writer="process"`` cases."""

from __future__ import annotations

import queue
import threading
import types
import weakref

import pytest
import torch

from resilient import Checkpointer, CheckpointerConfig, StorageError
from resilient.storage import checkpointer as checkpointer_module
from resilient.storage.persist import PersistJob
from resilient.storage.snapshot import StagingBuffer
from resilient.storage.workers import PersistProcess

pytestmark = pytest.mark.timeout(60)


class _Queue(list):
    """Records messages; a tensor only by weak reference (a queue to a process keeps none)."""

    def put(self, item) -> None:
        self.append(tuple(weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in item))


def _writer_without_process() -> PersistProcess:
    """A PersistProcess whose messages are recorded instead of sent to a process."""
    writer = PersistProcess.__new__(PersistProcess)
    writer._jobs, writer._lock, writer._pending, writer._buffers = _Queue(), threading.Lock(), {}, {}
    writer._next_id, writer._dead, writer._stopping = 0, None, False
    return writer


def _job(step: int) -> PersistJob:
    return PersistJob(step=step, attempt=f"attempt-{step}", rank=0, world_size=1, plans={}, regions=[])


def _tensor_with_id(wanted: int) -> torch.Tensor | None:
    """A new tensor whose id() is ``wanted`` (CPython reuses a freed object's address), or None."""
    keep = []
    for _ in range(1000):
        t = torch.zeros(8, dtype=torch.uint8)
        if id(t) == wanted:
            return t
        keep.append(t)  # held, so the next try gets another address
    return None


def test_a_new_staging_buffer_with_a_reused_id_is_sent_to_the_writer_again():
    writer = _writer_without_process()
    first = torch.ones(8, dtype=torch.uint8)
    writer.submit(_job(1), StagingBuffer(first), None, "h1")
    old_id = id(first)
    writer._pending.clear()  # its save finished
    del first  # the pool replaced it by a larger buffer: freed
    second = _tensor_with_id(old_id)
    if second is None:
        pytest.skip("CPython did not reuse the freed tensor's address here")
    writer.submit(_job(2), StagingBuffer(second), None, "h2")
    sent = {msg[1]: msg[2] for msg in writer._jobs if msg[0] == "buffer"}
    job2 = next(msg for msg in writer._jobs if msg[0] == "job" and '"step": 2' in msg[3])
    assert sent[job2[2]]() is second  # not the freed buffer the process still holds


def test_a_dead_writer_process_fails_its_saves_through_the_decision(tmp_path):
    from resilient.storage.objects import open_store
    from resilient.storage.url import parse_url

    writer = _writer_without_process()
    writer._store = open_store(parse_url(str(tmp_path)))
    writer._results = queue.Queue()
    writer._proc = types.SimpleNamespace(is_alive=lambda: False, exitcode=-9, pid=4242)
    done = []
    writer._on_done = lambda handle, buffer, stats, error: done.append((handle, error))
    writer._pending[1] = ("h1", None, _job(1))
    writer._stopping = True  # the collector returns once it has failed what it held
    writer._collect()
    [(handle, error)] = done
    assert handle == "h1" and isinstance(error, StorageError)
    assert "saving step 1 on rank 0: the checkpoint writer process (pid 4242) died with exit code -9" in str(error)
    assert not writer.alive()
    # The coordinator's decision is on storage: every other rank stops waiting for step 1 at once.
    assert (tmp_path / "step-000000001" / "attempt-1" / "failures" / "rank--0001.json").exists()


class _FakeProcessWriter:
    """Stands in for a writer process: the first one dies with its first save."""

    made: list[_FakeProcessWriter] = []

    def __init__(self, location, *args, **kwargs) -> None:
        self.location, self.on_done = location, args[-1]  # (location, [store,] on_done)
        self.dead = False
        self.made.append(self)

    def alive(self) -> bool:
        return not self.dead

    def submit(self, job, buffer, staged, handle) -> None:
        from resilient.storage.arrays import make_context
        from resilient.storage.objects import open_store
        from resilient.storage.persist import run_persist

        if len(self.made) == 1:
            self.dead = True
            self.on_done(handle, buffer, None, StorageError("the checkpoint writer process died"))
            return
        stats = run_persist(job, buffer.data, self.location, open_store(self.location), make_context(self.location))
        self.on_done(handle, buffer, stats, None)

    def stop_soon(self) -> None:
        pass

    def close(self, timeout_s: float) -> None:
        pass


def test_the_next_save_after_a_writer_died_gets_a_new_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointer_module, "PersistProcess", _FakeProcessWriter)
    _FakeProcessWriter.made.clear()
    ckpt = Checkpointer(str(tmp_path), config=CheckpointerConfig(writer="process", close_timeout_s=10))
    with pytest.raises(StorageError, match="writer process died"):
        ckpt.save(1, {"w": torch.ones(4)}).wait(timeout=10)
    assert ckpt.save(2, {"w": torch.full((4,), 2.0)}).wait(timeout=10).outcome == "committed"
    assert len(_FakeProcessWriter.made) == 2
    ckpt.close()
    assert ckpt.steps() == [2]


def _thread_writer(name: str, on_done):
    from resilient.storage.arrays import make_context
    from resilient.storage.objects import open_store
    from resilient.storage.url import parse_url
    from resilient.storage.workers import PersistThread

    location = parse_url(f"memory://{name}")
    store = open_store(location)
    store.check_root(create=True)
    return PersistThread(location, store, make_context(location), on_done), store


@pytest.mark.timeout(20)
def test_a_failing_on_done_does_not_kill_the_writer_thread():
    from resilient.storage.handle import SaveHandle

    calls = []

    def on_done(handle, buffer, stats, error):
        calls.append(handle.step)
        if len(calls) == 1:
            raise RuntimeError("releasing the staging buffer failed")
        handle.finish(stats)

    writer, _ = _thread_writer("on-done-raises", on_done)
    first, second = SaveHandle(1), SaveHandle(2)
    writer.submit(_job(1), StagingBuffer(torch.zeros(8, dtype=torch.uint8)), None, first)
    writer.submit(_job(2), StagingBuffer(torch.zeros(8, dtype=torch.uint8)), None, second)
    assert second.wait_done(5), "the save queued behind a failing on_done never completed"
    assert calls == [1, 2] and writer.alive()
    # The handle carries its save's own outcome (this empty job fails in persist), not the bookkeeping error.
    assert first.done() and isinstance(first.error, StorageError)
    writer.close(5)


@pytest.mark.timeout(20)
def test_a_dead_writer_threads_queued_saves_fail_through_the_decision(monkeypatch):
    from resilient.storage.commit import COMMIT_RANK, failure_key
    from resilient.storage.handle import SaveHandle
    from resilient.storage.workers import PersistThread

    monkeypatch.setattr(PersistThread, "_run", lambda self: None)  # the thread is gone at once
    writer, store = _thread_writer("dead-thread", lambda h, b, s, e: h.fail(e) if e else h.finish(s))
    writer._thread.join(5)
    handle = SaveHandle(3)
    writer.submit(_job(3), StagingBuffer(torch.zeros(8, dtype=torch.uint8)), None, handle)
    assert not writer.alive()
    writer.stop_soon()  # what the Checkpointer calls when it replaces the dead writer
    assert handle.wait_done(5), "the dead thread's queued save was orphaned"
    assert isinstance(handle.error, StorageError) and "writer thread died" in str(handle.error)
    assert store.read(failure_key(_job(3).attempt_key, COMMIT_RANK)) is not None  # decided: peers stop waiting


class _WriterThatCannotTakeJobs:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def alive(self) -> bool:
        return True

    def submit(self, job, buffer, staged, handle) -> None:
        raise RuntimeError("cannot hand the save over")

    def stop_soon(self) -> None:
        pass

    def close(self, timeout_s: float) -> None:
        pass


@pytest.mark.timeout(20)
def test_the_settle_thread_is_joined_at_exit_like_the_writers(monkeypatch):
    from resilient.storage import workers

    release = threading.Event()
    monkeypatch.setattr(checkpointer_module, "PersistThread", _WriterThatCannotTakeJobs)
    monkeypatch.setattr(checkpointer_module, "settle_failure", lambda job, store, error: release.wait(5))
    ckpt = Checkpointer("memory://settle-joined")
    handle = ckpt.save(1, {"w": torch.ones(4)})
    try:
        assert "resilient-ckpt-settle" in [t.name for t in list(workers._writer_threads)]
    finally:
        release.set()
    assert handle.wait_done(5)
