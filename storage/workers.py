"""Where stages 2 and 3 of a save run: one named writer thread (``PersistThread``), or one writer
process fed through shared memory (``PersistProcess``).

Both run the same ``run_persist`` on a ``PersistJob``; the choice is a measured trade-off (see
``CheckpointerConfig.writer``). Completion — stats or the error — is reported to ``on_done`` from
a background thread; errors are never swallowed, the Checkpointer latches them.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from resilient.errors import CommitError, ConfigError, StorageError, from_payload, to_payload
from resilient.metrics import SaveStats
from resilient.storage.commit import settle_failure
from resilient.storage.persist import PersistJob, run_persist
from resilient.storage.snapshot import StagingBuffer
from resilient.storage.url import Location

log = logging.getLogger(__name__)
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


def start_background(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread that the exit join (``_drain_writers``) waits for, like the writers'."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    _writer_threads.add(thread)
    thread.start()
    return thread


def _complete(on_done: OnDone, handle, buffer, stats: SaveStats | None, error: BaseException | None) -> None:
    """``on_done``, which must not kill the loop that calls it: a failing side effect (a buffer
    release, metrics) is logged and the handle still gets the save's own outcome."""
    try:
        on_done(handle, buffer, stats, error)
    except BaseException as e:  # noqa: BLE001 - the save's outcome is decided; this is bookkeeping
        log.error("accounting the save of step %s failed: %r", getattr(handle, "step", "?"), e)
        if handle.done():
            return
        if error is not None:
            handle.fail(error)
        else:
            handle.finish(stats)


class PersistThread:
    """TensorStore's C++ I/O releases the GIL; the Python work per region here is a few calls."""

    def __init__(self, location: Location, store, context, on_done: OnDone, nice: int = 0) -> None:
        self._location, self._store, self._context, self._on_done = location, store, context, on_done
        self._nice = nice
        self._death: BaseException | None = None  # what ended the thread early, if anything did
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="resilient-ckpt-writer", daemon=True)
        self._thread.start()
        _live_writers.add(self)
        _writer_threads.add(self._thread)

    def submit(self, job: PersistJob, buffer: StagingBuffer, staged, handle) -> None:
        self._queue.put((job, buffer, staged, handle))

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._lower_priority()
            while (item := self._queue.get()) is not _STOP:
                job, buffer, staged, handle = item
                stats, error = None, None
                try:
                    if staged is not None:
                        staged.synchronize()
                    stats = run_persist(job, buffer.data, self._location, self._store, self._context)
                except BaseException as e:  # latched by the Checkpointer and re-raised on wait()
                    error = e
                _complete(self._on_done, handle, buffer, stats, error)
        except BaseException as e:  # noqa: BLE001 - stored: the saves still queued fail with it (stop_soon)
            self._death = e
            log.error("the checkpoint writer thread died: %r", e)

    def _lower_priority(self) -> None:
        if self._nice and hasattr(os, "setpriority"):
            try:  # Linux: this thread only (TensorStore's own I/O threads keep their priority).
                # Relative, like os.nice in the writer process: a job already niced keeps its
                # writer below itself (an absolute value would put it above training).
                me = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + self._nice, 19))
            except OSError as e:  # a container may forbid it: persist at training's priority
                log.warning("cannot lower the checkpoint writer's priority: %s", e)

    def stop_soon(self) -> None:
        """Finish what is queued, then exit (used when the owner is garbage-collected). A thread
        that died leaves its queued saves to fail here, through the same decision as a dead
        writer process's (on a thread: a non-coordinator waits for the decision)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
        else:
            start_background(self._fail_queued, "resilient-ckpt-settle")

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                continue
            job, buffer, staged, handle = item
            error = StorageError(
                f"saving step {job.step} on rank {job.rank}: the checkpoint writer thread died "
                f"({self._death!r}); the next save starts a new one"
            )
            stats: SaveStats | None = None
            try:
                if staged is not None:
                    staged.synchronize()  # the copy must not land in a buffer handed to the next save
                settle_failure(job, self._store, error)
                stats, error = SaveStats(step=job.step, rank=job.rank), None
            except BaseException as e:  # latched by the Checkpointer and re-raised on wait()
                error = e
            _complete(self._on_done, handle, buffer, stats, error)

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
        if msg[0] == "forget":  # the pool dropped that buffer: free its shared memory here too
            buffers.pop(msg[1], None)
            continue
        _, job_id, buf_id, job_json = msg
        try:
            stats = run_persist(PersistJob.from_json(json.loads(job_json)), buffers[buf_id], location, store, context)
            results.put((job_id, "ok", stats.to_json()))
        except BaseException as e:  # crosses back as JSON: its class, message and traceback
            results.put((job_id, "error", to_payload(e)))


class PersistProcess:
    """A spawned writer process (TensorStore must not cross a fork) reading the staging buffers
    from shared memory; training's GIL never runs persist code.

    A writer process that dies (killed, out of memory) fails the saves it held, through the same
    decision as any failed save (``commit.settle_failure``, with ``store`` from this process), and
    reports ``alive() == False``: the Checkpointer then starts a fresh one for the next save."""

    _serials = itertools.count(1)

    def __init__(self, location: Location, store, on_done: OnDone, nice: int = 0) -> None:
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
        self._store, self._on_done = store, on_done
        self._pending: dict[int, tuple[Any, StagingBuffer, PersistJob]] = {}
        # Buffers the process holds, by a serial of our own: id() of a freed tensor is reused by
        # the next one (the pool grows by replacing a buffer), and the process then read a stale one.
        self._buffers: dict[int, tuple[weakref.ref, int]] = {}
        self._dead: str | None = None  # why the process is gone, once it is
        self._stopping = False
        self._next_id = 0
        self._lock = threading.Lock()
        self._collector = threading.Thread(target=self._collect, name="resilient-ckpt-collector", daemon=True)
        self._collector.start()
        _live_writers.add(self)
        _writer_threads.add(self._collector)

    def alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def submit(self, job: PersistJob, buffer: StagingBuffer, staged, handle) -> None:
        if staged is not None:
            staged.synchronize()  # the process reads host memory: the device copy must be done
        with self._lock:
            self._next_id += 1
            job_id = self._next_id
            self._pending[job_id] = (handle, buffer, job)
            if self._dead is not None:  # the collector fails it on its next tick
                return
            serial = self._buffer_serial(buffer.data)
        self._jobs.put(("job", job_id, serial, json.dumps(job.to_json())))

    def _buffer_serial(self, data) -> int:
        """The serial the process knows ``data`` by, sending it first if new (holds the lock)."""
        entry = self._buffers.get(id(data))
        if entry is not None and entry[0]() is data:
            return entry[1]
        for key, (ref, serial) in list(self._buffers.items()):
            if ref() is None or key == id(data):
                del self._buffers[key]
                self._jobs.put(("forget", serial))
        serial = next(self._serials)
        self._buffers[id(data)] = (weakref.ref(data), serial)
        self._jobs.put(("buffer", serial, data))
        return serial

    def _collect(self) -> None:
        while True:
            try:
                msg = self._results.get(timeout=0.5)
            except queue.Empty:
                if not self._proc.is_alive():
                    self._fail_pending()
                    if self._stopping:  # nothing more will be handed to it
                        return
                continue
            if msg == "stopped":
                return
            with self._lock:
                handle, buffer, _ = self._pending.pop(msg[0])
            if msg[1] == "ok":
                d = {k: v for k, v in msg[2].items() if k not in ("event", "throughput_gib_s")}
                _complete(self._on_done, handle, buffer, SaveStats(**d), None)
            else:  # the same class where known, the writer process's traceback as its cause
                _complete(self._on_done, handle, buffer, None, from_payload(msg[2]))

    def _fail_pending(self) -> None:
        """The process is gone: every save it held (or is handed later) fails, as the coordinator
        decides (this rank's failure marker lets it decide at once instead of at its timeout)."""
        with self._lock:
            if self._dead is None:
                self._dead = (
                    f"the checkpoint writer process (pid {self._proc.pid}) died with exit code "
                    f"{self._proc.exitcode}; the next save starts a new one"
                )
            pending, self._pending = self._pending, {}
        for handle, buffer, job in pending.values():
            stats = SaveStats(step=job.step, rank=job.rank)
            error = StorageError(f"saving step {job.step} on rank {job.rank}: {self._dead}")
            try:
                settle_failure(job, self._store, error)
            except BaseException as e:  # latched by the Checkpointer and re-raised on wait()
                _complete(self._on_done, handle, buffer, None, e)
            else:
                _complete(self._on_done, handle, buffer, stats, None)

    def stop_soon(self) -> None:
        self._stopping = True
        self._jobs.put(("stop",))

    def close(self, timeout_s: float) -> None:
        self._stopping = True
        self._jobs.put(("stop",))
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            raise CommitError(f"the checkpoint writer process did not stop within {timeout_s:.0f} s")
        deadline = time.monotonic() + timeout_s
        while self._pending and self._collector.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)  # a dead writer's saves are still being failed
        self._results.put("stopped")
        self._collector.join(timeout_s)
