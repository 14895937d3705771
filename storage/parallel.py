"""``run_parallel``: the one way the save and load paths spread I/O over plain threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sized


def run_parallel(tasks: Iterable[Callable[[], None]], threads: int) -> None:
    """Run ``tasks`` on up to ``threads`` plain threads (not an executor: saves also drain and loads
    also run at interpreter exit, when executors refuse new work); raise the first failure after all
    stop. ``tasks`` may be a generator: it is drawn one task at a time, in order (fault points rely on
    the first task starting first), so a reader plans its next reads while earlier ones run and
    holds no more than ``threads`` planned tasks at once. An error, raised by a task or by the
    generator, stops the drawing."""
    if isinstance(tasks, Sized):
        threads = min(threads, len(tasks))  # a thread per task at most; one task runs right here
    source = iter(tasks)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if errors:
                    return
                try:
                    task = next(source, None)
                except BaseException as e:  # noqa: BLE001 - re-raised below, on the caller's thread
                    errors.append(e)
                    return
            if task is None:
                return
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - re-raised below, on the caller's thread
                with lock:
                    errors.append(e)

    if threads <= 1:
        for task in source:
            task()
        return
    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    except BaseException as e:  # Ctrl-C while waiting: no task may still run (or write) after we raise
        with lock:
            errors.append(e)  # stops the drawing
        for w in workers:
            if w.ident is not None:
                w.join()
        raise
    if errors:
        raise errors[0]
