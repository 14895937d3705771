"""Prefetching with a torch DataLoader, keyed by the step's first global row.

The dataset is indexed by the cursor (RowKey) of a global batch and returns this share's rows of
it, so what a worker builds is a pure function of its index: the stream is the same for any
``num_workers`` (0 builds in the calling thread). The sampler walks cursors forward from a start,
one global batch at a time, without end; prefetching runs ahead of the trainer but never moves
the pipeline's cursor (only ``OmniPipeline.commit_step`` does).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from multiprocessing import resource_sharer
from types import TracebackType

from torch.utils.data import DataLoader, Dataset, Sampler

from resilient.trainer.data.stream import Batch, RowKey, RowStream


class _ShareOfStep(Dataset):
    """Index: the cursor of a global batch. Item: (cursor, this share's rows as a Batch)."""

    def __init__(self, stream: RowStream, share: int, num_shares: int) -> None:
        self._stream = stream
        self._share = share
        self._num_shares = num_shares

    def __getitem__(self, cursor: RowKey) -> tuple[RowKey, Batch]:
        cursor = RowKey(*cursor)
        keys = self._stream.rows_for_step(cursor, self._share, self._num_shares)
        return cursor, self._stream.batch(keys)


class _StepCursors(Sampler):
    """Cursors of consecutive global batches from start on (an endless stream)."""

    def __init__(self, stream: RowStream, start: RowKey) -> None:
        self._stream = stream
        self._start = start

    def __iter__(self) -> Iterator[RowKey]:
        cursor = self._start
        while True:
            yield cursor
            cursor = self._stream.advance(cursor, self._stream.config.global_rows)


def _as_is(item: tuple[RowKey, Batch]) -> tuple[RowKey, Batch]:
    # The dataset already returns a whole batch; module-level so worker processes can pickle it.
    return item


def _init_worker(worker_id: int) -> None:
    """``worker_init_fn``: see the two functions it calls."""
    _outlive_stop_signals()
    _quiet_orphaned_handoffs(worker_id)


def _outlive_stop_signals() -> None:
    """A loader worker ignores the signals that ask the rank to stop (SIGTERM and the signals
    ``run.preempt_signal`` may name): torchrun sends them to the rank's whole process group, and a
    worker that died of one would fail the rank's next batch while it saves the step it stops at
    (``trainer.preempt``). The worker still ends with its rank: the rank closes the loader, or
    torch's worker loop sees its parent gone, or torchrun kills the group after its grace."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def _quiet_orphaned_handoffs(worker_id: int) -> None:
    """``worker_init_fn``: a batch handed to a rank that is already dead is not the worker's error.

    A batch's tensors reach the rank as file descriptors passed by the worker's
    ``multiprocessing.resource_sharer`` thread (torch's default ``file_descriptor`` sharing), and
    that thread reports a failed hand-off through ``sys.excepthook``. So a rank SIGKILLed in the
    middle of taking a batch (a lost node, a chaos kill) left a raw ``ConnectionResetError``
    traceback from its orphaned worker on the terminal. Only that thread's connection errors are
    dropped: the other end is gone, and a live rank sees its own failed hand-off (its DataLoader
    raises). Every other report still goes to the hook that was installed."""
    report = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and tb is not None and tb.tb_frame.f_code is _SERVE_CODE:
            return
        report(kind, value, tb)

    sys.excepthook = excepthook


# The fd-passing thread's loop: its frame is the outermost of the tracebacks it reports.
_SERVE_CODE = resource_sharer._ResourceSharer._serve.__code__


class PrefetchLoader:
    """Batches of consecutive steps, built ahead by DataLoader workers.

    ``batch_at(cursor)`` returns the batch of the step starting at cursor. Asking again for the
    same cursor (the trainer retries a step it did not commit) returns the same batch without
    consuming the prefetch queue; asking for any cursor other than the next one (after a restore)
    restarts the workers from there.
    """

    def __init__(self, stream: RowStream, share: int, num_shares: int) -> None:
        self._stream = stream
        self._dataset = _ShareOfStep(stream, share, num_shares)
        self._iterator: Iterator[tuple[RowKey, Batch]] | None = None
        self._expected: RowKey | None = None
        self._last: tuple[RowKey, Batch] | None = None

    def batch_at(self, cursor: RowKey) -> Batch:
        if self._last is not None and self._last[0] == cursor:
            return self._last[1]
        if self._iterator is None or self._expected != cursor:
            self._restart(cursor)
        assert self._iterator is not None
        got, batch = next(self._iterator)
        if got != cursor:  # the sampler and the dataset disagree: a bug, not a user error
            raise AssertionError(f"loader produced the batch of {got}, expected {cursor}")
        self._last = (cursor, batch)
        self._expected = self._stream.advance(cursor, self._stream.config.global_rows)
        return batch

    def _restart(self, start: RowKey) -> None:
        self.close()
        self._stream.plan(start.epoch)  # built once here, inherited by forked workers
        cfg = self._stream.config
        workers = cfg.num_workers
        loader = DataLoader(
            self._dataset,
            sampler=_StepCursors(self._stream, start),
            batch_size=None,
            collate_fn=_as_is,
            num_workers=workers,
            prefetch_factor=cfg.prefetch_factor if workers else None,
            timeout=cfg.worker_timeout_s if workers else 0,
            worker_init_fn=_init_worker if workers else None,
        )
        self._iterator = iter(loader)

    def close(self) -> None:
        """Stop the worker processes now; a later batch_at starts new ones."""
        # Dropping the iterator would also stop them, but only when it is garbage-collected;
        # torch has no public call for it, hence the private one (absent when num_workers is 0).
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None
        self._expected = None
        self._last = None
