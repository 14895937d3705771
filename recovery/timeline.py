"""Which RAM snapshots belong to the state being restored: the run's identity and its timeline.

A snapshot in a node store is only as good as the history it came from. Two things make one wrong
for a restart although its step number looks right:

- another run: the run directory was deleted or ``checkpoint.url`` points elsewhere, and the node
  store (its path a hash of run.dir, or a configured ``recovery.store_dir``) still holds the old
  run's snapshots;
- an abandoned timeline: a restore that does not come from RAM (the persistent tier, a chosen
  ``checkpoint.load_step``, a fresh start, a heal from a live replica group) rewinds the run or
  joins another group's history, and snapshots taken before it belong to a history the run may no
  longer have.

So every snapshot carries ``(run_id, timeline)``, and only snapshots of the current pair are
eligible:

``run_id``     random, minted once per checkpoint root as ``<root>/run.json`` (created if absent
               through the storage objects API: atomic on every backend, the first creator wins).
               The checkpoints and the RAM snapshots of one run share it; a new root is a new run.
``timeline``   ``"<incarnation>-<random>"``, a new one after every restore; ``incarnation``
               counts them within a run (0: its first).

Every restore branches: the new timeline names its ``parent`` and the ``branch_step`` it began at.
A restore that does not come from RAM keeps nothing of its parent eligible (it rewound the run or
joined another group's history). A RAM restore to step S keeps its parent's snapshots at or before
S eligible (they are the history the new branch grew from), never one after S: a node that was
absent during the restore still holds the parent's steps after S, and when it comes back its ranks
must not restore them next to the other ranks' snapshots of the same step numbers retrained on the
new branch (two trajectories, every crc passing). ``ancestors`` lists each eligible ancestor with
the newest step of it that may restore (the smallest branch step on the way down to the current
timeline).

The current timeline is recorded in ``<run.dir>/group<G>/timeline.json`` (path from ``runfiles``),
one per replica group, written by the group's rank 0 before the group trains on it, and a copy in
every node's RAM store (``RamTier.timeline``: each rank writes the agreed timeline next to its
snapshots), so that a run directory lost with a pod (Kubernetes) does not make every snapshot
ineligible: the newest node copy of this root stands in for it (``current``). Why not in the
checkpoint root: the RAM tier must restore while storage is unreachable (its reason to
exist), and each replica group has its own stores and rewinds on its own (a per-group object in
the root would be one more storage write on every restart). Losing every copy is safe: with no
record of this run nothing in RAM is eligible, and the next timeline's random part is new, so a
deleted run dir can never bring an abandoned timeline back (a bare counter restarting at 0 could).
The record names its checkpoint root: with storage unreachable it is trusted for that root only.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from resilient.errors import IntegrityError, StorageError
from resilient.runfiles import TIMELINE_FILE, group_file, read_json, write_json
from resilient.storage.objects import ObjectStore

log = logging.getLogger(__name__)

RUN_OBJECT = "run.json"
"""``<checkpoint root>/run.json``: ``{"run_id", "created"}``, written once, never rewritten."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """The history RAM snapshots are tagged with and must match to be restored."""

    run_id: str
    incarnation: int
    timeline: str
    """``"<incarnation>-<random>"``; "" for "none is current" (matches no snapshot)."""
    root: str = ""
    """The checkpoint root URL whose ``run.json`` names ``run_id``."""
    load_step: int | None = None
    """The ``checkpoint.load_step`` in force when this timeline began: a restart with the same
    value goes on in this history instead of rewinding to that step again."""
    parent: str = ""
    """The timeline this one branched from ("" for the run's first)."""
    branch_step: int | None = None
    """The step this timeline began at (the restored step; None for the run's first)."""
    ancestors: tuple[tuple[str, int], ...] = ()
    """``(timeline, newest eligible step)`` of each ancestor whose snapshots may still restore,
    nearest first (only along RAM restores; a restore not from RAM starts with none)."""

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["ancestors"] = [list(a) for a in self.ancestors]
        return body

    @classmethod
    def from_json(cls, raw: Any) -> Timeline | None:
        """The timeline ``raw`` describes; None for anything else (a damaged record is no record)."""
        if not isinstance(raw, dict):
            return None
        names = ("run_id", "incarnation", "timeline", "root", "load_step", "parent", "branch_step")
        fields = {k: raw.get(k) for k in names}
        fields["parent"] = fields["parent"] or ""
        if not all(isinstance(fields[k], str) for k in ("run_id", "timeline", "root", "parent")):
            return None
        if not all(_is_int(fields[k]) for k in ("incarnation", "load_step", "branch_step") if fields[k] is not None):
            return None
        ancestors = raw.get("ancestors") or []
        if not isinstance(ancestors, list) or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and _is_int(a[1]) for a in ancestors
        ):
            return None
        if fields["incarnation"] is None:
            return None
        return cls(**fields, ancestors=tuple((a[0], a[1]) for a in ancestors))

    def why_not(self, run_id: str, timeline: str, step: int) -> str | None:
        """Why a snapshot of ``step`` tagged ``(run_id, timeline)`` may not restore now (None: it may)."""
        if run_id != self.run_id:
            return f"taken by run {run_id or '(none)'!r}, not by run {self.run_id!r} of the checkpoint root"
        if not self.timeline:
            return f"no current timeline of run {self.run_id!r} is recorded in the run directory"
        if timeline == self.timeline:
            return None
        newest = dict(self.ancestors).get(timeline)
        if newest is None:
            return f"timeline {timeline!r} was abandoned: a restore not from RAM or a load_step began {self.timeline!r}"
        if step > newest:
            return (
                f"step {step} of timeline {timeline!r} comes after step {newest}, where the current "
                f"timeline {self.timeline!r} branched off it"
            )
        return None

    def eligible(self, run_id: str, timeline: str, step: int) -> bool:
        return self.why_not(run_id, timeline, step) is None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


UNTRACKED = Timeline(run_id="", incarnation=0, timeline="untracked")
"""A RAM tier's timeline until a restore policy sets one (a tier used on its own, in tests)."""


def record_path(run_dir: str, group: int) -> str:
    return group_file(run_dir, TIMELINE_FILE, group)


def read_record(run_dir: str, group: int) -> Timeline | None:
    return Timeline.from_json(read_json(record_path(run_dir, group)))


def root_run_id(store: ObjectStore) -> str:
    """The run id of the checkpoint root, minted on first use. Raises StorageError when the root
    cannot be read or written, IntegrityError when its ``run.json`` is damaged."""
    data = store.read(RUN_OBJECT)
    if data is None:
        record = {"run_id": secrets.token_hex(8), "created": round(time.time(), 3)}
        store.write_if_absent(RUN_OBJECT, json.dumps(record).encode())
        data = store.read(RUN_OBJECT)  # ours, or the one a concurrent creator won with
        if data is None:
            raise StorageError(f"{store.location.url}/{RUN_OBJECT} vanished right after it was created; retry")
    try:
        run_id = json.loads(data)["run_id"]
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id is {run_id!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(
            f"{store.location.url}/{RUN_OBJECT} is damaged ({e}); delete it to give the root a new run id "
            f"(RAM snapshots of the old one are then not restored)"
        ) from e
    return run_id


def current(store: ObjectStore, run_dir: str, group: int, records: Sequence[Any] = ()) -> Timeline:
    """Rank 0's side: the timeline whose snapshots may restore now (``timeline == ""``: none may).
    ``records``: what every rank's node store recorded (``RamTier.node_record``); the newest of this
    root stands in for the run directory's record when that is gone (a pod restarted with it)."""
    url = store.location.url
    record = read_record(run_dir, group) or newest(records, url)
    try:
        run_id = root_run_id(store)
    except StorageError:
        # Storage unreachable: RAM may still restore the run, on the record of this same root.
        if record is not None and record.root == url:
            return record
        return Timeline(run_id="", incarnation=0, timeline="", root=url)
    if record is not None and record.run_id == run_id:
        return record
    return Timeline(run_id=run_id, incarnation=0, timeline="", root=url)


def newest(records: Sequence[Any], root: str) -> Timeline | None:
    """The newest (highest incarnation) of ``records`` naming ``root``; None when none does."""
    found = [t for t in map(Timeline.from_json, records) if t is not None and t.root == root and t.timeline]
    return max(found, key=lambda t: t.incarnation, default=None)


def start(
    store: ObjectStore, run_dir: str, group: int, load_step: int | None = None, *, step: int | None = None
) -> Timeline:
    """Rank 0's side: begin a new timeline of the root's run at ``step`` (the step restored, not
    from RAM), recorded before it is returned; nothing of its parent stays eligible."""
    run_id = root_run_id(store)
    previous = read_record(run_dir, group)
    incarnation = previous.incarnation + 1 if previous is not None and previous.run_id == run_id else 0
    return _begin(run_dir, group, run_id, incarnation, store.location.url, load_step, parent=previous, branch_step=step)


def _begin(
    run_dir: str,
    group: int,
    run_id: str,
    incarnation: int,
    root: str,
    load_step: int | None,
    *,
    parent: Timeline | None = None,
    branch_step: int | None = None,
    ancestors: tuple[tuple[str, int], ...] = (),
) -> Timeline:
    timeline = Timeline(
        run_id,
        incarnation,
        f"{incarnation}-{secrets.token_hex(4)}",
        root,
        load_step,
        parent=parent.timeline if parent is not None and parent.run_id == run_id else "",
        branch_step=branch_step,
        ancestors=ancestors,
    )
    write_json(record_path(run_dir, group), timeline.to_json())
    return timeline


MAX_ANCESTORS = 32
"""Eligible ancestors kept in a record: a snapshot of an older one has long been evicted (a store
keeps a few steps), and the record must not grow with every restart of a long run."""


def branch(store: ObjectStore, run_dir: str, group: int, *, parent: Timeline, step: int) -> Timeline:
    """Rank 0's side after a RAM restore of ``step`` in ``parent``: a child timeline, recorded
    before it is returned, in which ``parent``'s snapshots at or before ``step`` stay eligible (and
    its ancestors' up to the smaller of their bound and ``step``). Needs no storage (``store`` is
    unused: the RAM tier restores while storage is unreachable)."""
    del store
    inherited = [(name, min(newest, step)) for name, newest in parent.ancestors]
    ancestors = ((parent.timeline, step), *inherited)[:MAX_ANCESTORS] if parent.timeline else ()
    return _begin(
        run_dir,
        group,
        parent.run_id,
        parent.incarnation + 1,
        parent.root,
        parent.load_step,
        parent=parent,
        branch_step=step,
        ancestors=ancestors,
    )


def healed(
    store: ObjectStore,
    run_dir: str,
    group: int,
    load_step: int | None = None,
    *,
    storage: bool = True,
    step: int | None = None,
) -> Timeline:
    """Rank 0's side after a heal from a live replica group: a new timeline, recorded.

    Not the recorded one: the live group may itself have rewound (restored an older step and begun
    a new history) since this group's snapshots were taken, so they may belong to a history the job
    no longer has; kept current, a later restart could restore one (say step 50 of the abandoned
    history) and the quorum would heal every group from it. ``load_step`` is recorded as applied:
    the live group's state already descends from it.

    A heal never needed storage and must not start to (an outage would crash-loop every healing
    group): the recorded run id of this root is trusted, as ``current`` does offline. With no record
    of this root the root's run id is read only when ``storage`` (the RAM tier is on); else, or when
    storage is unreachable, a timeline that matches nothing (new snapshots never restore)."""
    record = read_record(run_dir, group)
    url = store.location.url
    if record is not None and record.root == url:
        incarnation = record.incarnation + 1
        return _begin(run_dir, group, record.run_id, incarnation, url, load_step, parent=record, branch_step=step)
    if storage:
        try:
            return start(store, run_dir, group, load_step, step=step)
        except (StorageError, IntegrityError) as e:  # unreachable, or a damaged run.json
            log.warning("after the heal: %s; RAM snapshots of this group cannot restore until its next restore", e)
    return Timeline(run_id="", incarnation=0, timeline="", root=url)


def incarnation_of(timeline: str) -> int | None:
    """The incarnation in a timeline token ``"<incarnation>-<random>"`` (None: not one)."""
    head, _, _ = timeline.partition("-")
    return int(head) if head.isdigit() else None
