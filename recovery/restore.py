"""The one restore policy: where a (re)started group's state comes from.

Top to bottom, the first tier that has the state wins:

1. ``peer``        a live replica group healed this one inside the first torchft quorum (torchft
                   did the transfer; the policy records it and reads nothing);
2. ``own``         the RAM tier's newest step every rank of the group can get, if it is not older
3. ``buddy``       than the newest committed persistent step: each rank's own snapshot, else its
                   buddy node's copy (``resilient.recovery.ram.restore``);
4. ``persistent``  the newest committed checkpoint, on any mesh;
5. ``fresh``       nothing to restore: step 0.

The group decides together before any rank loads, and falls back together (the model is Orbax's
emergency checkpoint manager: decide globally, try the fast tier, fall back through one collective):
rank 0 lists the committed steps and every rank gets the same list or the same error
(``dist.agree``); the RAM decision is one collective over the group; the persistent load agrees on
its manifest inside the Checkpointer.

Storage errors: a root that does not exist yet (a local directory, an empty memory store) is a
fresh start; a missing bucket or an unreachable endpoint is an error (starting afresh there would
silently drop a run's progress), raised on every rank, unless the RAM tier restores the run.

Every rank writes one ``restore`` event to ``<run.dir>/events.jsonl`` (group, rank, step, source,
bytes, seconds, storage_reads, excluded), except when ``checkpoint.resume`` is off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilient import dist as rdist
from resilient.errors import ResilientError, StorageError
from resilient.recovery.ram.tier import RamTier
from resilient.runfiles import group_id, write_event
from resilient.storage.checkpointer import Checkpointer

log = logging.getLogger(__name__)

SOURCES = ("own", "buddy", "persistent", "peer", "fresh")
"""Where a restored state came from: the one vocabulary of events, chaos scenarios and tools (the
policy tries peer first, then own and buddy RAM, then persistent)."""

_RAM_WHERE = {"own": "this node's RAM", "buddy": "the buddy node's RAM"}


@dataclass(frozen=True, slots=True)
class PeerHeal:
    """A heal from a live replica group, already applied inside the first torchft quorum."""

    step: int
    bytes: int
    seconds: float


@dataclass(slots=True)
class RestoreResult:
    """What this rank restored: the fields of its ``restore`` event, and the state it loaded."""

    step: int
    """The step training continues from (0: fresh)."""
    source: str
    """One of ``SOURCES``."""
    bytes: int = 0
    """Bytes this rank loaded (RAM snapshot, checkpoint reads or heal transfer)."""
    seconds: float = 0.0
    storage_reads: int = 0
    """Objects this rank read from persistent storage (0 for a RAM or peer restore)."""
    excluded: list[dict[str, Any]] = field(default_factory=list)
    """RAM snapshots the decision skipped: ``{"step", "source", "reason"}`` each."""

    @property
    def loaded(self) -> bool:
        """Whether this call loaded a step into the state (RAM or persistent; a heal is torchft's)."""
        return self.source in ("own", "buddy", "persistent")


def restore(
    target: Callable[[], dict[str, Any]],
    apply: Callable[[dict[str, Any]], None],
    *,
    checkpointer: Checkpointer,
    ram: RamTier | None,
    run_dir: str,
    peer: PeerHeal | None = None,
    resume: bool = True,
    say: Callable[[str], None] | None = None,
    layout: str = "",
) -> RestoreResult:
    """Collective over the group: decide where this group's state comes from and load it.

    ``target()`` builds the state dict to load into (called only when a tier is tried: building it
    can initialize the optimizer's state); ``apply(state)`` puts a loaded state in place (its time
    counts in ``seconds``); ``peer``: the heal of the first quorum, if there was one; ``resume``:
    ``checkpoint.resume`` (off: a fresh start, no event); ``say``: where the one-line outcome goes
    ("resumed from step N of ... on <layout> in X s").
    """
    if peer is not None:
        result = RestoreResult(peer.step, "peer", peer.bytes, peer.seconds)
    elif not resume:
        return RestoreResult(0, "fresh")
    else:
        result = _from_tiers(target(), apply, checkpointer, ram)
    write_event(
        run_dir,
        "restore",
        group=group_id(),
        rank=rdist.get_rank(),
        step=result.step,
        source=result.source,
        bytes=result.bytes,
        seconds=round(result.seconds, 6),
        storage_reads=result.storage_reads,
        excluded=result.excluded,
    )
    if say is not None and result.source != "peer":
        say(describe(result, checkpointer.url, layout))
    return result


def _from_tiers(
    state: dict[str, Any], apply: Callable[[dict[str, Any]], None], checkpointer: Checkpointer, ram: RamTier | None
) -> RestoreResult:
    """Own RAM, buddy RAM, persistent, fresh: the RAM tier's step wins when it is not older."""
    start = time.perf_counter()
    persistent, listing_error = _newest_persistent(checkpointer, ram_may_restore=ram is not None)
    reads_before = checkpointer.storage_reads
    result = RestoreResult(0, "fresh")
    if ram is not None:
        fast = ram.restore(state, persistent)
        result.excluded = fast.excluded
        if fast.step is not None and fast.source is not None:
            result.step, result.source, result.bytes = fast.step, fast.source, fast.bytes
    if not result.loaded and listing_error is not None:
        raise listing_error  # on every rank: each got the same error, and the RAM decision is collective
    if not result.loaded and persistent is not None:
        result.step, result.source = checkpointer.load(state, step=persistent), "persistent"
        result.bytes = checkpointer.restore_stats[-1].bytes_read
    if result.loaded:
        apply(state)
    result.seconds = time.perf_counter() - start
    result.storage_reads = checkpointer.storage_reads - reads_before
    return result


def _newest_persistent(checkpointer: Checkpointer, *, ram_may_restore: bool) -> tuple[int | None, StorageError | None]:
    """The newest committed step (None: none yet), or the listing error when RAM may still restore."""
    try:
        steps = committed_steps(checkpointer)
    except StorageError as e:
        if not ram_may_restore:
            raise
        # Storage unreachable: snapshots in RAM may still restore the run (newest known step).
        log.warning("[rank %d] %s; trying the RAM tier alone", rdist.get_rank(), e)
        return None, e
    return (steps[-1] if steps else None), None


def committed_steps(checkpointer: Checkpointer) -> list[int]:
    """Committed steps under the checkpoint root, ascending; [] for a root that does not exist yet.

    Collective over the group: rank 0 lists, every rank gets the list or the same StorageError (a
    rank raising alone would leave its peers waiting in the next collective).
    """
    return rdist.agree(lambda: _list_committed(checkpointer), src=0)


def _list_committed(checkpointer: Checkpointer) -> list[int]:
    # A missing local directory or empty memory store means a fresh run; a missing bucket or an
    # unreachable endpoint is an error (starting afresh there would silently drop a run's progress).
    try:
        checkpointer.store.check_root(create=True)
        try:
            return checkpointer.steps()
        except StorageError:
            if checkpointer.location.scheme == "memory":
                return []
            raise
    except ResilientError as e:
        raise StorageError(f"cannot list checkpoints to resume from: {e}") from e


def describe(result: RestoreResult, url: str, layout: str) -> str:
    """The one line a run prints about its restore (``layout``: the mesh it resumed on)."""
    if not result.loaded:
        return f"no checkpoint under {url}: starting at step 0"
    where = _RAM_WHERE.get(result.source, url)
    return f"resumed from step {result.step} of {where} on {layout} in {result.seconds:.2f} s"
