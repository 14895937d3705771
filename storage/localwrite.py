"""Write a rank's files of one save attempt to a local file system, then make them durable in one
pass, before the rank's receipt says they exist (DESIGN §5).

Why not TensorStore here: its file driver writes each object to a temporary file, fsyncs it,
renames it and fsyncs the directory, one object after another as far as the journal is
concerned. An attempt's directory is fresh and invisible until its manifest exists, so nothing
needs the temporary-file dance: each file is created once (``O_EXCL``), written with one
``writev`` straight from the staging buffer, and the whole attempt is made durable at the end by
parallel ``fdatasync`` of its files and ``fsync`` of every directory that gained an entry, which
the file system's journal commits together instead of once per object. While it writes, a rank
asks the kernel to start writing each file's pages to disk (``sync_file_range``, which does not
wait), so the disk works while later files are still being copied into the page cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Iterable

from resilient.errors import StorageError
from resilient.storage.parallel import run_parallel

IOV_MAX = 1024  # Linux's limit on buffers per writev
SYNCFS_MIN_FILES = 64
"""From this many files on, one ``syncfs`` makes them durable instead of one fdatasync each (many
small files: several times faster; benchmarks/README.md, "Choices in the code"); for a few big
files, per-file fdatasync waits for nothing but our data."""


WRITEBACK_STEP_BYTES = 32 << 20
"""A file's bytes are handed to the kernel this many at a time, each piece's writeback started as
soon as it is in the page cache (``SYNC_FILE_RANGE_WRITE``: start, do not wait): the copy and the
disk overlap instead of taking turns (benchmarks/README.md, "Choices in the code")."""
WRITEBACK_MIN_BYTES = 1 << 20
"""A file's tail of fewer bytes is left to the durability pass: tiny files (norms, biases, zarr.json)
are many, and the pass at the end flushes them together."""
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>


def _load_libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def _libc_function(name: str, argtypes: list):
    """A function of libc (Linux), or None where it does not exist."""
    fn = getattr(_LIBC, name, None) if _LIBC is not None else None
    if fn is not None:
        fn.argtypes = argtypes
    return fn


_SYNCFS = _libc_function("syncfs", [ctypes.c_int])
_SYNC_FILE_RANGE = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


_WRITEBACK_ERRORS = (errno.EIO, errno.ENOSPC, errno.EROFS, errno.EDQUOT)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` to disk, without waiting.
    Durability still comes from the fdatasync/syncfs pass after every write (starting writeback
    with SYNC_FILE_RANGE_WRITE alone neither clears nor consumes the error that pass reports). An
    I/O error it does report is raised (``OSError``); "not supported here" is ignored: a hint."""
    if _SYNC_FILE_RANGE is None:
        return
    if _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        if err in _WRITEBACK_ERRORS:
            raise OSError(err, os.strerror(err))


TRUSTED_SYNCFS_TYPES = ("ext4", "xfs", "btrfs", "tmpfs")
"""Local file systems whose syncfs writes back and reports errors. Network and FUSE mounts may
return 0 without the server making anything durable: they get per-file fsync."""


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def _fs_type(path: str) -> str | None:
    """The type of the file system mounted at the longest mount point above ``path``."""
    path, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                mount = fields[1].replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return None
    return kind


def syncfs_is_trusted(path: str) -> bool:
    """syncfs reports writeback errors from Linux 5.8 on, and only local file systems honour it."""
    return _SYNCFS is not None and _kernel_at_least(5, 8) and _fs_type(path) in TRUSTED_SYNCFS_TYPES


def _byte_view(buffer) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _pieces(buffers: list, limit: int) -> list[tuple[int, list[memoryview]]]:
    """``buffers`` back to back, cut into pieces of at most ``limit`` bytes and ``IOV_MAX`` views
    (a buffer may be split between two), each with its offset in the file. One pass, whatever the
    buffer count (a pack of small tensors hands over thousands)."""
    pieces: list[tuple[int, list[memoryview]]] = []
    batch: list[memoryview] = []
    offset = size = 0
    for buffer in buffers:
        view = _byte_view(buffer)
        while view.nbytes:
            if size >= limit or len(batch) >= IOV_MAX:
                pieces.append((offset, batch))
                offset, batch, size = offset + size, [], 0
            take = min(view.nbytes, limit - size)
            batch.append(view if take == view.nbytes else view[:take])
            size += take
            view = view[take:]
    if batch:
        pieces.append((offset, batch))
    return pieces


def _writev_all(fd: int, buffers: list) -> int:
    """``writev`` every buffer, whatever the kernel accepts per call (partial writes resumed),
    starting the writeback of every ``WRITEBACK_STEP_BYTES`` as it lands; returns the bytes written."""
    done = started = 0
    for offset, views in _pieces(buffers, WRITEBACK_STEP_BYTES):
        done = offset + sum(v.nbytes for v in views)
        while views:
            views = _advance(views, os.writev(fd, views))
        if done - started >= WRITEBACK_STEP_BYTES:
            start_writeback(fd, started, done - started)
            started = done
    if done - started >= WRITEBACK_MIN_BYTES:
        start_writeback(fd, started, done - started)
    return done


def _advance(views: list[memoryview], written: int) -> list[memoryview]:
    """What is left of ``views`` once ``written`` bytes of them went out."""
    n = 0
    while n < len(views) and written >= views[n].nbytes:
        written -= views[n].nbytes
        n += 1
    rest = views[n:]
    if written:
        rest[0] = rest[0][written:]
    return rest


def _pwrite_parallel(fd: int, buffers: list, threads: int) -> int:
    """Write ``buffers`` back to back from offset 0, in pieces of about ``WRITEBACK_STEP_BYTES``
    each written (and its writeback started) by one of ``threads`` threads; returns the bytes."""
    pieces = _pieces(buffers, WRITEBACK_STEP_BYTES)
    run_parallel([lambda o=o, b=b: _pwrite_piece(fd, o, b) for o, b in pieces], threads)
    return pieces[-1][0] + sum(v.nbytes for v in pieces[-1][1]) if pieces else 0


def _pwrite_piece(fd: int, offset: int, views: list[memoryview]) -> None:
    start = offset
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        views = _advance(views, written)
    if offset - start >= WRITEBACK_MIN_BYTES:
        start_writeback(fd, start, offset - start)


class AttemptFiles:
    """The files one rank adds under ``root`` during one attempt, and the directories it made.

    ``write`` may be called from several threads; ``make_durable`` once, after every write.
    """

    def __init__(self, root: str, *, expected_files: int) -> None:
        self.root = root
        # Decided up front: per-file durability syncs each file on the fd that wrote it (so a
        # writeback error cannot be lost between close and a reopen).
        self.use_syncfs = expected_files >= SYNCFS_MIN_FILES and syncfs_is_trusted(root)
        self._files: list[str] = []
        self._new_entries_in: set[str] = set()  # directories that gained a file or subdirectory
        self._known_dirs: set[str] = set()
        self._lock = threading.Lock()
        self._syncfs_fd: int | None = None
        if self.use_syncfs:
            # Opened before the first write: syncfs reports a writeback error to an fd opened
            # before it happened, even if another process's syncfs has seen it since (errseq).
            self._make_dir(root)
            self._syncfs_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        """Release the fd kept for syncfs (``make_durable`` closes it too); safe to call twice."""
        fd, self._syncfs_fd = self._syncfs_fd, None
        if fd is not None:
            os.close(fd)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def sync_dirs_anyway(self, paths: Iterable[str]) -> None:
        """Directories to fsync even if another attempt or rank created the entry in them: a
        failed earlier attempt may have made ``step-N/`` and died before its own durability pass."""
        self._new_entries_in.update(os.path.join(self.root, p) for p in paths)

    def make_dirs(self, keys: Iterable[str]) -> None:
        """Create the parent directories of ``keys``, remembering which ones gained an entry."""
        for key in keys:
            self.make_parent(key)

    def make_parent(self, key: str) -> None:
        """Create the directory ``key`` goes in, and its missing parents. Safe from several
        threads: the writers call it per object, so directories are made while other objects are
        written (each mkdir or create costs about a millisecond on ext4; benchmarks/README.md)."""
        self._make_dir(os.path.dirname(self._path(key)))

    def _make_dir(self, path: str) -> None:
        with self._lock:
            if path in self._known_dirs:
                return
        try:
            self._mkdir(path)
        except FileNotFoundError:  # its parent is missing too: make that first (no stat per directory)
            self._make_dir(os.path.dirname(path))
            self._mkdir(path)
        with self._lock:
            self._known_dirs.add(path)

    def _mkdir(self, path: str) -> None:
        try:
            os.mkdir(path)
        except FileExistsError:
            return  # another rank (or another of our threads) made it; the maker syncs its entry
        except FileNotFoundError:
            raise  # the parent is missing: _make_dir makes it and tries again
        except OSError as e:
            raise StorageError(f"cannot create directory {path}: {e.strerror}") from e
        with self._lock:
            self._new_entries_in.add(os.path.dirname(path))

    def write(self, key: str, buffers: list, *, threads: int = 1) -> int:
        """Create ``key`` (it must not exist) holding ``buffers`` back to back; returns its size.
        With ``threads`` > 1 a big file is written in ``WRITEBACK_STEP_BYTES`` pieces at their
        offsets by that many threads (``pwritev``): page-cache copies of one big pack run side by
        side as those of several objects did."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(f"cannot create {path}: {e.strerror}") from e
        try:
            nbytes = _pwrite_parallel(fd, buffers, threads) if threads > 1 else _writev_all(fd, buffers)
            if not self.use_syncfs:
                os.fdatasync(fd)
        except OSError as e:
            raise StorageError(f"writing {path} failed: {e.strerror}") from e
        finally:
            os.close(fd)
        with self._lock:
            self._files.append(path)
            self._new_entries_in.add(os.path.dirname(path))
        return nbytes

    def make_durable(self, threads: int) -> None:
        """Return once every file written and every directory that gained an entry is on disk:
        one ``syncfs`` of the file system for many files, else fdatasync of each file and fsync of
        each such directory, in parallel so the journal commits them together."""
        if self.use_syncfs:
            try:
                _syncfs_on(self._syncfs_fd, self.root)
            finally:
                self.close()
            return
        # the files were synced as they were written; now the entries naming them
        run_parallel([lambda d=d: _sync(d, directory=True) for d in sorted(self._new_entries_in)], threads)


def _syncfs_on(fd: int | None, path: str) -> None:
    """syncfs(2) on ``fd``, an fd of ``path`` opened before the writes it must cover: it reports
    writeback errors (Linux >= 5.8) that happened since ``fd`` was opened, or that nobody has seen."""
    if fd is None or _SYNCFS(fd) != 0:
        err = ctypes.get_errno() if fd is not None else errno.EBADF
        raise StorageError(f"making the files under {path} durable (syncfs) failed: {os.strerror(err)}")


def _sync(path: str, *, directory: bool) -> None:
    try:
        fd = os.open(path, (os.O_RDONLY if directory else os.O_WRONLY) | os.O_CLOEXEC)
        try:
            os.fsync(fd) if directory else os.fdatasync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise StorageError(f"making {path} durable failed: {e.strerror}") from e
