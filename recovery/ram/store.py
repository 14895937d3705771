"""The node-local snapshot store of the RAM tier: files in tmpfs that outlive the worker processes.

Paths (the contract tools and ``resilient-chaos`` rely on)::

    <store>/group<G>/node<N>/               simulated node N of replica group G (one machine)
    <store>/group<G>/node-<identity>/        the real node of that identity (``ram.node_id``)
        own/rank<R>/step-<S>.json            index of rank R's snapshot of step S (visible = complete)
        own/rank<R>/slot<K>.bin              the bytes, in a reused slot file
        buddy/rank<R>/...                    copies this node keeps for rank R of its buddy node

A real node's directory is named by its identity, never by a node index: a restart that renumbers
nodes finds each store where it was. ``R`` is the rank the snapshot was taken on (its place in the
mesh, so its shard); after a renumbering, a directory may hold a rank that now runs elsewhere, and
every index records the rank, node identity and local rank it was taken on, so the restore finds a
rank's snapshot by what it is, not by where it lies (``ram.restore``).

The store is ``<store_dir>/<key>``, ``store_dir`` being ``recovery.store_dir`` or ``/dev/shm/resilient``
and key a hash of the absolute run.dir, so a restarted worker of the same run finds it and two runs
on one machine never share it; the job's ranks hold it (``recovery.ownership``) while they run.
The path is only a place: which snapshots may restore is decided by the run identity and
timeline every index carries (``recovery.timeline``), so a new run in an old place never resumes the old
run's snapshots, and retention drops those first.

One ``RankStore`` directory per rank (``own/rank<R>`` for this node's ranks, ``buddy/rank<R>`` for
the copies kept for a buddy node). A snapshot is two files:

- ``slot<K>.bin``: the local tensors' bytes, back to back at 64-byte aligned offsets. Slot files
  are reused round-robin and stay mapped, so a snapshot is one memcpy into memory that is already
  resident (a fresh allocation per snapshot pays the page faults every time);
- ``step-<S>.json``: the index (tensor FQN, dtype, shape, offset, crc32c; the JSON leaves; the
  topology it was taken on). It is written last, by rename: a snapshot is visible only complete.

Both are the packing format of ``recovery.snapshot_format`` (``SnapshotIndex``, ``layout_tensors``),
which a live heal's state uses too.

A slot is reused only once no visible index points at it and its lease is released (``reserve``
leases it until the snapshot is published and copied to the buddy), so a replication in flight
never sees its bytes change. Nothing here is pickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import Callable

import torch

from resilient.errors import ConfigError
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ownership import held
from resilient.recovery.ram.node_id import sanitize
from resilient.recovery.snapshot_format import SnapshotIndex
from resilient.recovery.timeline import Timeline, incarnation_of

log = logging.getLogger(__name__)

DEFAULT_STORE_ROOT = "/dev/shm/resilient"
STORE_MARKER = "store.json"
_INDEX_RE = re.compile(r"^step-(\d{9})\.json$")


class _Slot:
    """One reusable slot file, mapped once per process."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != max(nbytes, 1):
                os.ftruncate(fd, max(nbytes, 1))
                # Reserve the pages now: a full tmpfs is an OSError (ENOSPC) here, naming the file,
                # instead of a SIGBUS in the middle of the copy into the mapping.
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            # MAP_POPULATE: fault the pages in at once (a new slot is touched whole by its first copy).
            self._map = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]


class RankStore:
    """The snapshots of one rank in one directory, newest ``keep`` visible."""

    def __init__(self, directory: str, keep: int, current: Callable[[], Timeline] | None = None) -> None:
        self.directory, self.keep = directory, keep
        self.current = current
        """The timeline the run's record names now (the tier's ``timeline``); None: unknown."""
        self._slots: dict[str, _Slot] = {}
        self._leases: dict[str, int] = {}
        self._lock = threading.Lock()
        self.unreadable: list[str] = []
        """Why index files were skipped by the last ``indexes()`` (corrupt, truncated, other version)."""

    # -- reading -----------------------------------------------------------------------------

    def indexes(self) -> dict[int, SnapshotIndex]:
        """Every visible snapshot by step; unreadable index files are skipped (and logged)."""
        out: dict[int, SnapshotIndex] = {}
        self.unreadable = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return out
        for name in names:
            match = _INDEX_RE.match(name)
            if not match:
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path) as f:
                    index = SnapshotIndex.from_json(json.load(f))
            except (OSError, ValueError, TypeError, KeyError) as e:
                log.warning("ignoring unreadable RAM snapshot index %s: %s", path, e)
                self.unreadable.append(f"{name}: {e}")
                continue
            out[index.step] = index
        return out

    def data(self, index: SnapshotIndex) -> torch.Tensor:
        """The snapshot's bytes (a mapping of its slot; the caller leases it while reading)."""
        path = os.path.join(self.directory, index.slot)
        size = os.stat(path).st_size
        return self._slot(index.slot, size).data[: index.nbytes]

    def release(self, slot: str) -> None:
        with self._lock:
            self._leases[slot] -= 1

    # -- writing -----------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> tuple[str, torch.Tensor]:
        """A slot of ``nbytes`` for ``step``, leased to the caller (``release`` it after publishing):
        never one a visible snapshot or a reader uses, so the ``keep`` visible snapshots stay intact
        until the new one is published. At most keep + leases + 1 slot files exist."""
        os.makedirs(self.directory, exist_ok=True)
        with self._lock:
            used = {i.slot for i in self.indexes().values()} | {s for s, n in self._leases.items() if n > 0}
            k = 0
            while f"slot{k}.bin" in used:
                k += 1
            name = f"slot{k}.bin"
            self._leases[name] = self._leases.get(name, 0) + 1
        return name, self._slot(name, nbytes).data

    def warm(self, nbytes: int, count: int) -> None:
        """Create and map the missing slots 0..``count``-1 of ``nbytes`` (background thread): else
        ``reserve`` makes one (fallocated, faulted in) on the training thread when it needs it."""
        os.makedirs(self.directory, exist_ok=True)
        for name in (f"slot{k}.bin" for k in range(count)):
            with self._lock:
                ready = name in self._slots and self._slots[name].nbytes == nbytes
            if not ready:
                self._slot(name, nbytes)

    def publish(self, index: SnapshotIndex) -> None:
        """Make ``index`` visible (atomic rename), then drop the snapshots known abandoned and
        ``index``'s timeline's beyond ``keep``."""
        path = os.path.join(self.directory, f"step-{index.step:09d}.json")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(index.to_json(), f)
        os.replace(tmp, path)
        self._evict(self.keep, (index.run_id, index.timeline))

    def remove(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, f"step-{step:09d}.json"))

    def _evict(self, keep: int, published: tuple[str, str]) -> None:
        # A snapshot known abandoned can never restore again: it goes first, whatever its step
        # (ranking by step alone let an old run's step 40 evict a new run's step 2 on every publish).
        # Known abandoned: another run's, or one of an older incarnation than the current timeline
        # that is not an eligible ancestor's, or, when what was published is of the timeline the
        # run's record names now, any other not eligible (records only move forward). Never a newer
        # timeline's: a late publish tagged with an older one (a snapshot or copy in flight across a
        # restore) must not wipe the current snapshots. ``keep`` counts the snapshots of what was
        # published and, when that is the current timeline, its eligible ancestors' with it.
        current = self.current() if self.current is not None else Timeline(published[0], 0, published[1])
        recorded = self.current is not None and published == (current.run_id, current.timeline)
        indexes = self.indexes()
        abandoned = [s for s, i in indexes.items() if _abandoned(i, current, recorded=recorded)]
        for step in abandoned:
            self.remove(step)

        def counted(index: SnapshotIndex) -> bool:
            if (index.run_id, index.timeline) == published:
                return True
            return recorded and current.eligible(index.run_id, index.timeline, index.step)

        steps = sorted(s for s, i in indexes.items() if counted(i) and s not in abandoned)
        for step in steps[: max(0, len(steps) - keep)]:
            self.remove(step)

    def drop_abandoned(self, current: Timeline) -> None:
        """Remove every snapshot ``current`` (the timeline the run's record names now) does not
        keep eligible (known abandoned, as ``_evict`` decides after a publish of it), then the
        slots they used. For a store nothing publishes into any more (``RamView.left_here``), which
        ``_evict`` never visits."""
        for step, index in self.indexes().items():
            if _abandoned(index, current, recorded=True):
                self.remove(step)
        self.drop_spare_slots()

    def drop_spare_slots(self) -> None:
        """Delete slot files no visible snapshot and no reader uses."""
        with self._lock:
            used = {i.slot for i in self.indexes().values()} | {s for s, n in self._leases.items() if n > 0}
            try:
                names = os.listdir(self.directory)
            except FileNotFoundError:  # nothing was ever stored here
                return
            for name in [n for n in names if n.startswith("slot") and n not in used]:
                self._slots.pop(name, None)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))

    def remove_newer(self, step: int) -> None:
        """Hide every snapshot after ``step`` (after a restore to ``step``, they are another timeline)."""
        for newer in [s for s in self.indexes() if s > step]:
            self.remove(newer)

    def bytes_used(self) -> int:
        """Bytes of all slot files here, spares included (``drop_spare_slots`` frees those)."""
        try:
            return sum(e.stat().st_size for e in os.scandir(self.directory) if e.name.startswith("slot"))
        except FileNotFoundError:
            return 0

    def _slot(self, name: str, nbytes: int) -> _Slot:
        with self._lock:
            slot = self._slots.get(name)
        if slot is None or slot.nbytes != nbytes:
            slot = _Slot(os.path.join(self.directory, name), nbytes)
            with self._lock:
                self._slots[name] = slot
        return slot


class NodeStores:
    """The rank stores of one node directory (``own/rank<R>``, ``buddy/rank<R>``). The copies kept
    for a rank are one store, which the channel's server threads and the restore share."""

    def __init__(self, node_dir: str, keep: int, current: Callable[[], Timeline] | None = None) -> None:
        self.node_dir, self.keep, self.current = node_dir, keep, current
        self._kept: dict[int, RankStore] = {}
        self._lock = threading.Lock()

    def own(self, rank: int) -> RankStore:
        """``rank``'s own store on this node (a new instance: the tier holds the one of its rank)."""
        return RankStore(os.path.join(self.node_dir, "own", f"rank{rank}"), self.keep, self.current)

    def kept(self, rank: int) -> RankStore:
        """The copies this node keeps for ``rank``."""
        with self._lock:
            store = self._kept.get(rank)
            if store is None:
                directory = os.path.join(self.node_dir, "buddy", f"rank{rank}")
                store = self._kept[rank] = RankStore(directory, self.keep, self.current)
            return store

    def ranks(self, kind: str) -> list[int]:
        """The ranks with a directory under ``kind`` (``own`` or ``buddy``) on this node."""
        try:
            names = os.listdir(os.path.join(self.node_dir, kind))
        except FileNotFoundError:
            return []
        return [int(name.removeprefix("rank")) for name in names if name.removeprefix("rank").isdigit()]


def _abandoned(index: SnapshotIndex, current: Timeline, *, recorded: bool) -> bool:
    """Whether ``index``'s snapshot is known never to restore again (see ``RankStore._evict``;
    ``recorded``: ``current`` is the timeline the run's record names now)."""
    if current.eligible(index.run_id, index.timeline, index.step):
        return False
    if index.run_id != current.run_id or recorded:
        return True
    mine, theirs = incarnation_of(current.timeline), incarnation_of(index.timeline)
    return mine is not None and theirs is not None and theirs < mine


def check_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) if needed and refuse one another user owns or may write: the
    snapshots' checksums are not a MAC, so nobody else may be able to plant a snapshot here."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"{path} must be owned by this user (uid {os.geteuid()}) and writable by no one "
            f"else (owner uid {info.st_uid}, mode {oct(info.st_mode & 0o777)})"
        )


def mark_store(root: str) -> None:
    """Create (or touch) ``<root>/store.json``: a directory this code owns, and when it was last used."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    path = os.path.join(root, STORE_MARKER)
    if os.path.exists(path):
        os.utime(path)
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"created": time.time(), "pid": os.getpid()}, f)
    os.replace(tmp, path)


def clean_stale_stores(parent: str, keep_root: str, stale_after_s: float) -> list[str]:
    """Remove sibling stores of dead runs: only directories with our marker, untouched for
    ``stale_after_s``; never ``keep_root``. Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.is_dir() or os.path.abspath(entry.path) == os.path.abspath(keep_root):
            continue
        marker = os.path.join(entry.path, STORE_MARKER)
        try:
            age = time.time() - os.stat(marker).st_mtime
        except FileNotFoundError:
            continue  # not ours: never touched
        if age > stale_after_s and not held(entry.path):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
            log.info("removed the RAM store of a dead run: %s (unused for %.0f s)", entry.path, age)
    return removed


# --- where the stores are -------------------------------------------------------------------------


def run_dir_key(run_dir: str) -> str:
    """Stable across restarts of one run dir, different for two run dirs on one machine (a place,
    not an identity: see ``recovery.timeline``)."""
    return hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]


def store_root(config: RamTierConfig, run_dir: str) -> str:
    """``<store_dir>/<run-dir-key>``, ``store_dir`` the configured one or ``/dev/shm/resilient``:
    keyed by run under any ``store_dir``, so two runs configured with one never share a store."""
    parent = os.path.abspath(config.store_dir) if config.store_dir else DEFAULT_STORE_ROOT
    return os.path.join(parent, run_dir_key(run_dir))


def node_store_dir(config: RamTierConfig, run_dir: str, group: int, node: int | str) -> str:
    """The directory of node ``node`` of replica group ``group`` (wipe it to simulate losing the
    node): a simulated node's index, or a real node's identity (sanitized)."""
    name = f"node{node}" if isinstance(node, int) else f"node-{sanitize(node)}"
    return os.path.join(store_root(config, run_dir), f"group{group}", name)


def ranks_per_node(config: RamTierConfig, world_size: int) -> int:
    """Ranks per (simulated) node: the config, else torchrun's LOCAL_WORLD_SIZE, else the world."""
    per_node = config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise ConfigError(
            f"recovery.ranks_per_node={per_node} must divide the group's world size {world_size} "
            f"(every node holds the same number of ranks)"
        )
    return per_node
