"""Where the outcomes of background saves are accounted (``SaveLedger``) and raised (``SaveOutcomes``).

A save's outcome is decided once, by the coordinator (``commit.py``), and every rank's writer
learns the same decision, but not at the same moment. So an error is raised only at a collective
call (``save``, ``wait``) where every rank shares what it has latched: every rank raises the
first one, the same error at the same call, and every rank marks that attempt as raised, so a
rank that learns of the failure later does not raise it a second time.
"""

from __future__ import annotations

import logging
from typing import Any

from resilient import dist
from resilient.errors import to_payload
from resilient.metrics import JsonlSink, SaveStats
from resilient.storage.handle import SaveHandle
from resilient.storage.snapshot import StagingPool

log = logging.getLogger(__name__)


class SaveOutcomes:
    """The handles of this rank's saves until their errors, if any, have been raised."""

    def __init__(self) -> None:
        self._handles: list[SaveHandle] = []
        self._raised: set[str] = set()  # attempts whose error every rank has raised

    def track(self, handle: SaveHandle) -> None:
        self._handles.append(handle)

    def pop_first_error(self) -> tuple[dict | None, BaseException | None]:
        """Consume the first finished save whose error nobody has reported yet: returns it as what
        to share with the other ranks (``{"attempt", "error"}``) and as the error itself, and marks
        it reported; (None, None) if none. Other failed saves stay for the next call (dropping
        them lost every failure but the first among the saves one call found finished)."""
        found: SaveHandle | None = None
        kept = []
        for h in self._handles:
            settled = h.done() and (h.error is None or h.error_reported or h.attempt in self._raised)
            if settled:
                continue
            if found is None and h.done():
                found = h
                h.error_reported = True
                continue
            kept.append(h)
        self._handles = kept
        if found is None:
            return None, None
        return {"attempt": found.attempt, "error": to_payload(found.error)}, found.error

    def settle(self, shared: list[Any], rank: int, local: BaseException | None) -> None:
        """``shared``: what every rank popped (rank order). Raises the first one on every rank."""
        latched = [s for s in shared if s]
        if not latched:
            return
        self._raised.update(s["attempt"] for s in latched if s.get("attempt"))
        for h in self._handles:
            if h.attempt in self._raised:
                h.error_reported = True  # raised already, by this call on every rank
        dist.raise_first(shared, rank, local)

    def agree(self, group: Any, rank: int, late: BaseException | None = None) -> None:
        """One collective: every rank's first unreported error (or ``late``, a wait that timed out)
        is shared, and every rank raises the first rank's, or returns if there is none. With
        ``late`` nothing is consumed: the saves' own errors are raised at a later call."""
        if late is not None:
            shared, local = {"attempt": None, "error": to_payload(late)}, late
        else:
            shared, local = self.pop_first_error()
        self.settle(dist.all_gather_json(shared, group=group), rank, local)


class SaveLedger:
    """Where finished saves are accounted: frees the staging buffer, records stats, latches errors
    on the handle. Called on a background thread; holds no reference to the Checkpointer."""

    def __init__(self, *, rank: int, sink: JsonlSink) -> None:
        self.rank = rank
        self.sink = sink
        self.stats: list[SaveStats] = []
        self.pool: StagingPool | None = None
        self.sink_failed = False

    def record(self, stats: SaveStats) -> None:
        """Account a save. A metrics file that cannot be written is logged (once), never raised:
        this runs on the writer thread before the handle completes, and a side effect must not
        decide a save's fate (it killed the writer and left the committed save's handle hanging)."""
        self.stats.append(stats)
        try:
            self.sink.write(stats.to_json())
        except Exception as e:  # noqa: BLE001 - any failure of a side effect, see above
            if not self.sink_failed:
                log.warning("[rank %d] cannot record save metrics to %s: %s", self.rank, self.sink.path, e)
            self.sink_failed = True

    def on_done(self, handle: SaveHandle, buffer, stats: SaveStats | None, error: BaseException | None) -> None:
        if buffer is not None:
            self.pool.release(buffer)
        if error is not None:
            handle.stats.outcome = "failed"
            self.record(handle.stats)
            log.error(
                "[rank %d] save of step %d failed: %s",
                self.rank,
                handle.step,
                error,
                extra={"event": "save_failed", "step": handle.step},
            )
            handle.fail(error)
            return
        blocked = handle.stats  # what save() measured in the foreground
        stats.snapshot_s, stats.waited_s, stats.policy = blocked.snapshot_s, blocked.waited_s, blocked.policy
        stats.total_s = stats.snapshot_s + stats.persist_s + stats.commit_s
        self.record(stats)
        handle.finish(stats)
