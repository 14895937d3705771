"""``gc_paused``: Python's cyclic garbage collector held off while a save or load builds and drops
many small objects (a manifest of thousands of arrays, its JSON, receipts, read plans).

Each allocation-heavy phase otherwise triggers full collections, and a full collection walks every
object of the process: in a trainer, torch's and the model's hundreds of thousands. Parsing a
many-tensor manifest took an order of magnitude longer with the collector on than off, in a process
holding that state (benchmarks/README.md, "Choices in the code"). The objects made inside are
freed by reference counting as usual; only cycles wait for the next collection after the phase.

The collector's switch is process-wide and the writer thread runs beside the training thread, so
the pauses nest through a counter: the first phase to enter records whether the collector was on,
the last to leave restores that. A phase is one rank's own CPU work (encoding and laying out its
packs, building and encoding the manifest, parsing one or a receipt), never its I/O: a save's
upload or fsync can take minutes on S3, and the training thread beside it must keep its cyclic
collection meanwhile (the objects still alive then are walked by a later collection, the price of
that). Never a wait on another rank: a waiting rank leaves the collector on.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off cyclic garbage collection inside the block (reentrant, any thread)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
