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
