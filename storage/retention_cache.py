"""What retention learned about committed steps, so a commit does not look at every kept step again.

Retention after each commit read every committed step's manifest and listed its directory (a HEAD,
two GETs and a LIST per kept step on S3): with ``keep_last`` unset a run's commits grew costlier
and slower with its length, and object stores bill and throttle per request. A committed manifest
is immutable (created iff absent, never rewritten; a restore that falls back past a damaged step
moves it away, and a new commit of that step writes other bytes), so what one look at a step found
holds while its manifest keeps the same bytes: the attempt it names, the attempt set aside beside
it, and that its directory held nothing left to delete ("settled").

Why an entry that went stale is safe (another writer, another process of this run, a resumed run):
an entry is only ever used to *skip* work on a step, never to delete. Every deletion is still
decided from what was read in the same pass: a whole step beyond ``keep_last`` is checked to be
committed first, and ``keep_last`` still reads the manifests it counts (their bytes are compared
with the entry, so a damaged or replaced manifest is looked at afresh). A step that is new to this
process (another writer's, or every step after a restart: the cache is per process) is seen by
the listing of the root and looked at in full. What skipping can miss — a stray attempt that
appears later in a settled step (a writer killed while saving a step someone else committed) —
is found by the round-robin re-check: each pass looks again at the settled step checked longest
ago, so every kept step is looked at again within as many commits as there are kept steps.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass


def manifest_digest(data: bytes) -> bytes:
    """A cryptographic digest, not a crc: no crafted or chance collision passes one manifest for another."""
    return hashlib.blake2b(data, digest_size=32).digest()


@dataclass(slots=True)
class CheckedStep:
    digest: bytes
    """BLAKE2b of the manifest bytes the check read: the commit it describes."""
    settled: bool
    """Nothing was left in the step's directory for a later pass: every stray was deleted, none was
    spared as another writer's save in flight."""
    checked: int
    """The pass that last looked at the step in full (the oldest is re-checked first)."""


class CheckedSteps:
    """One checkpoint root's committed steps as retention last saw them, in this process.

    A pass (``apply_retention``) holds ``lock``; a pass that finds it held (two Checkpointers of
    one process on one root) looks at every step instead of waiting. Entries a pass makes are
    staged and kept only once its deletions all succeeded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._edit = threading.Lock()  # ``forget`` comes from a restore's thread, outside any pass
        self._steps: dict[int, CheckedStep] = {}
        self._staged: dict[int, CheckedStep] = {}
        self._pass = 0
        self._due: int | None = None

    def begin_pass(self, listed: list[int]) -> None:
        """Start a pass over the steps the root listing shows: entries of steps gone are dropped,
        and the settled step checked longest ago is due for a look in full."""
        self._pass += 1
        present = set(listed)
        with self._edit:
            self._staged.clear()
            self._steps = {step: entry for step, entry in self._steps.items() if step in present}
            settled = [(entry.checked, step) for step, entry in self._steps.items() if entry.settled]
        self._due = min(settled)[1] if settled else None

    def presumes_committed(self, step: int) -> bool:
        """Whether the listing may take the step as committed without asking the store (the pass
        then reads its manifest, or skips it, or checks it before deleting it)."""
        return step in self._steps

    def skips(self, step: int) -> bool:
        """Whether a pass that needs no manifest of this step (every step kept) may leave it alone."""
        entry = self._steps.get(step)
        return entry is not None and entry.settled and step != self._due

    def settled_for(self, step: int, digest: bytes) -> bool:
        """Whether the step was settled when its manifest held these very bytes (and is not due)."""
        entry = self._steps.get(step)
        return entry is not None and entry.settled and entry.digest == digest and step != self._due

    def stage(self, step: int, digest: bytes, *, settled: bool) -> None:
        with self._edit:
            self._staged[step] = CheckedStep(digest=digest, settled=settled, checked=self._pass)

    def forget(self, step: int) -> None:
        with self._edit:
            self._steps.pop(step, None)
            self._staged.pop(step, None)

    def confirm(self, deleted_steps: set[int]) -> None:
        """The pass's deletions succeeded: keep what it learned (not about the steps it deleted)."""
        with self._edit:
            for step, entry in self._staged.items():
                if step not in deleted_steps:
                    self._steps[step] = entry
            for step in deleted_steps:
                self._steps.pop(step, None)
            self._staged.clear()

    def __len__(self) -> int:
        return len(self._steps)


_BY_ROOT: dict[str, CheckedSteps] = {}
_BY_ROOT_LOCK = threading.Lock()


def checked_steps(url: str) -> CheckedSteps:
    """This process's record of the root at ``url`` (one per root: every Checkpointer of the
    process on that root shares it)."""
    with _BY_ROOT_LOCK:
        return _BY_ROOT.setdefault(url, CheckedSteps())


def forget_step(url: str, step: int) -> None:
    """The step's manifest was moved away here (set aside): passes stop presuming it committed.
    Without the pass's lock (a pass may be deleting for a while): an entry that survives a race is stale,
    which is safe (see above), and the next full look at the step drops it."""
    with _BY_ROOT_LOCK:
        known = _BY_ROOT.get(url)
    if known is not None:
        known.forget(step)
