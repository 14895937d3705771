"""Where stages 2 and 3 of a save run: one named writer thread (``PersistThread``), or one writer
process fed through shared memory (``PersistProcess``).

Both run the same ``run_persist`` on a ``PersistJob``; the choice is a measured trade-off (see
``CheckpointerConfig.writer``). Completion — stats or the error — is reported to ``on_done`` from
a background thread; errors are never swallowed, the Checkpointer latches them.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from resilient.errors import CommitError, ConfigError, StorageError, from_payload, to_payload
from resilient.metrics import SaveStats
from resilient.storage.persist import PersistJob, run_persist
from resilient.storage.snapshot import StagingBuffer
from resilient.storage.url import Location

OnDone = Callable[[Any, StagingBuffer, SaveStats | None, BaseException | None], None]
_STOP = None
_EXIT_JOIN_TIMEOUT_S = 60.0
_live_writers: weakref.WeakSet = weakref.WeakSet()
_writer_threads: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _drain_writers() -> None:
    """Let writer and collector threads end before the interpreter tears down.

    Such a thread can hold the last reference to staging tensors (the Checkpointer was dropped);
    freeing a tensor releases the GIL, and a daemon thread that retakes it after finalization
    began is killed by a forced unwind through torch's noexcept code: the process aborts with
    "terminate called without an active exception" (seen under CPU load). Daemon threads still
    run during atexit, so stop and join them here — threads, not writers: a writer can already be
    freed while its thread is still freeing the buffers. The timeout keeps a hung storage call
    from hanging exit.
    """
    for writer in list(_live_writers):
        writer.stop_soon()
    for thread in list(_writer_threads):
        if thread is not threading.current_thread():
            thread.join(_EXIT_JOIN_TIMEOUT_S)


class PersistThread:
    """TensorStore's C++ I/O releases the GIL; the Python work per region here is a few calls."""

    def __init__(self, location: Location, store, context, on_done: OnDone, nice: int = 0) -> None:
        self._location, self._store, self._context, self._on_done = location, store, context, on_done
        self._nice = nice
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="resilient-ckpt-writer", daemon=True)
        self._thread.start()
        _live_writers.add(self)
        _writer_threads.add(self._thread)

    def submit(self, job: PersistJob, buffer: StagingBuffer, staged, handle) -> None:
        self._queue.put((job, buffer, staged, handle))

    def _run(self) -> None:
        if self._nice and hasattr(os, "setpriority"):
            # Linux: this thread only (TensorStore's own I/O threads keep their priority).
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while (item := self._queue.get()) is not _STOP:
            job, buffer, staged, handle = item
            stats, error = None, None
            try:
                if staged is not None:
                    staged.synchronize()
                stats = run_persist(job, buffer.data, self._location, self._store, self._context)
            except BaseException as e:  # latched by the Checkpointer and re-raised on wait()
                error = e
            self._on_done(handle, buffer, stats, error)

    def stop_soon(self) -> None:
        """Finish what is queued, then exit (used when the owner is garbage-collected)."""
        self._queue.put(_STOP)

    def close(self, timeout_s: float) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise CommitError(f"the checkpoint writer thread did not stop within {timeout_s:.0f} s")


def _process_main(url: str, options: dict, jobs, results, nice: int) -> None:
    if nice:
        os.nice(nice)  # every thread of the writer, TensorStore's pool included, yields to training
    from resilient.storage.arrays import make_context
    from resilient.storage.objects import open_store
    from resilient.storage.url import parse_url

    location = parse_url(url, options)
    store, context = open_store(location), make_context(location)
    buffers: dict[int, Any] = {}
    while (msg := jobs.get())[0] != "stop":
        if msg[0] == "buffer":
            buffers[msg[1]] = msg[2]
            continue
        _, job_id, buf_id, job_json = msg
        try:
            stats = run_persist(PersistJob.from_json(json.loads(job_json)), buffers[buf_id], location, store, context)
            results.put((job_id, "ok", stats.to_json()))
        except BaseException as e:  # crosses back as JSON: its class, message and traceback
            results.put((job_id, "error", to_payload(e)))


class PersistProcess:
    """A spawned writer process (TensorStore must not cross a fork) reading the staging buffers
    from shared memory; training's GIL never runs persist code."""

    def __init__(self, location: Location, on_done: OnDone, nice: int = 0) -> None:
        import torch.multiprocessing as mp

        if location.scheme == "memory":
            raise ConfigError("writer='process' cannot write to memory:// (another process); use writer='thread'")
        ctx = mp.get_context("spawn")
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        options = {**location.options, "endpoint_url": location.endpoint, "region": location.region}
        self._proc = ctx.Process(
            target=_process_main,
            args=(location.url, options, self._jobs, self._results, nice),
            name="resilient-ckpt-writer",
            daemon=True,
        )
        self._proc.start()
        self._on_done = on_done
        self._pending: dict[int, tuple[Any, StagingBuffer]] = {}
        self._buffers: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._collector = threading.Thread(target=self._collect, name="resilient-ckpt-collector", daemon=True)
        self._collector.start()
        _live_writers.add(self)
        _writer_threads.add(self._collector)

    def submit(self, job: PersistJob, buffer: StagingBuffer, staged, handle) -> None:
        if staged is not None:
            staged.synchronize()  # the process reads host memory: the device copy must be done
        with self._lock:
            self._next_id += 1
            job_id = self._next_id
            key = id(buffer.data)
            if key not in self._buffers:
                self._buffers[key] = job_id
                self._jobs.put(("buffer", job_id, buffer.data))
            self._pending[job_id] = (handle, buffer)
        self._jobs.put(("job", job_id, self._buffers[key], json.dumps(job.to_json())))

    def _collect(self) -> None:
        while True:
            try:
                msg = self._results.get(timeout=0.5)
            except queue.Empty:
                if not self._proc.is_alive():
                    code = self._proc.exitcode
                    self._fail_all(StorageError(f"the checkpoint writer process died (exit code {code})"))
                    return
                continue
            if msg == "stopped":
                return
            with self._lock:
                handle, buffer = self._pending.pop(msg[0])
            if msg[1] == "ok":
                d = {k: v for k, v in msg[2].items() if k not in ("event", "throughput_gib_s")}
                self._on_done(handle, buffer, SaveStats(**d), None)
            else:  # the same class where known, the writer process's traceback as its cause
                self._on_done(handle, buffer, None, from_payload(msg[2]))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for handle, buffer in pending.values():
            self._on_done(handle, buffer, None, error)

    def stop_soon(self) -> None:
        self._jobs.put(("stop",))

    def close(self, timeout_s: float) -> None:
        self._jobs.put(("stop",))
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            raise CommitError(f"the checkpoint writer process did not stop within {timeout_s:.0f} s")
        self._results.put("stopped")
        self._collector.join(timeout_s)
