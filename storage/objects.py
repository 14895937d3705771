"""Small-object I/O: manifests, receipts, ``latest``, listings and deletes.

Tensor bytes never go through here (TensorStore writes them, see ``arrays.py``); this layer holds
the commit protocol's primitives: an atomic durable write, an atomic *create* that fails if the
key exists (the commit point), listing and prefix deletion. Keys are relative to the checkpoint
root. Three backends with one protocol: local files, S3 (boto3), and an in-process memory store
shared with TensorStore's ``memory`` kvstore for unit tests.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid
from typing import Protocol

from resilient.errors import StorageError
from resilient.storage.url import Location


class ObjectStore(Protocol):
    location: Location

    def read(self, key: str) -> bytes | None: ...
    def write(self, key: str, data: bytes) -> None: ...
    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` iff absent. True iff it now holds ``data`` written by this call, including
        a try of this call whose answer was lost (the store's retry then finds our own bytes); False
        if another writer's bytes are there."""
        ...

    def exists(self, key: str) -> bool: ...
    def list_children(self, key: str) -> list[str]: ...
    def list_keys(self, key: str) -> list[str]: ...
    def delete_prefix(self, key: str) -> None: ...
    def check_root(self, *, create: bool) -> None: ...


def open_store(location: Location) -> ObjectStore:
    if location.scheme == "file":
        return FileObjectStore(location)
    if location.scheme == "s3":
        from resilient.storage.s3 import S3ObjectStore

        return S3ObjectStore(location)
    return MemoryObjectStore(location)


def write_advisory(store: ObjectStore, key: str, data: bytes) -> None:
    """Write an object that nothing relies on being durable (``latest``: the manifests are the
    truth, and every reader of it takes a missing, old or unreadable one): local files skip the
    two fsyncs of ``write``, a journal commit each; object stores write as usual."""
    unsynced = getattr(store, "write_unsynced", None)
    (unsynced or store.write)(key, data)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_or_equal(ours: str, path: str, data: bytes) -> bool:
    """``path`` is the file ``ours`` (same inode) or holds exactly ``data``. A ``path`` gone again
    raises (FileNotFoundError, an OSError): "someone else's" would be a guess either way."""
    if os.path.samefile(ours, path):
        return True
    with open(path, "rb") as f:
        return f.read(len(data) + 1) == data


class FileObjectStore:
    """Local files; writes are write-temp + fsync + rename (+ fsync of the directory)."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self.root = "/" + location.prefix

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def _fail(self, op: str, key: str, err: OSError) -> StorageError:
        reason = err.strerror or err
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageError(f"{op} {self._path(key)!r} failed: {reason}; free space there (the disk is full)")
        return StorageError(f"{op} {self._path(key)!r} failed: {reason}; check the path and its permissions")

    def read(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._fail("reading", key, e) from e

    def _write_temp(self, path: str, data: bytes) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            tmp = self._write_temp(path, data)
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise self._fail("writing", key, e) from e

    def write_unsynced(self, key: str, data: bytes) -> None:
        """``write`` without its fsyncs: readers see the old bytes or the new ones, never a mix,
        but a crash may lose the update (or, on some file systems, leave the file empty). Only for
        advisory objects (``write_advisory``)."""
        path = self._path(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            raise self._fail("writing", key, e) from e

    def write_if_absent(self, key: str, data: bytes) -> bool:
        # link() never replaces an existing name, so exactly one creator wins, atomically.
        path = self._path(key)
        try:
            tmp = self._write_temp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                # On NFS a link whose reply was lost is retried by the client and fails with EEXIST
                # although it took effect: the name then points at our own inode (or our bytes).
                if not _same_or_equal(tmp, path, data):
                    return False
            finally:
                os.unlink(tmp)
            _fsync_dir(os.path.dirname(path))
            return True
        except OSError as e:
            raise self._fail("creating", key, e) from e

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def list_children(self, key: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(key)))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._fail("listing", key, e) from e

    def list_keys(self, key: str) -> list[str]:
        base = self._path(key)
        out = []
        for dirpath, _, files in os.walk(base):
            rel = os.path.relpath(dirpath, base)
            out.extend(f if rel == "." else f"{rel}/{f}" for f in files)
        return sorted(out)

    def delete_prefix(self, key: str) -> None:
        path = self._path(key)
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
        except OSError as e:
            raise self._fail("deleting", key, e) from e

    def check_root(self, *, create: bool) -> None:
        if os.path.isdir(self.root):
            return
        if os.path.exists(self.root):
            raise StorageError(f"checkpoint root {self.root!r} exists but is not a directory")
        if not create:
            raise StorageError(f"checkpoint directory {self.root!r} does not exist; check the URL (nothing was read)")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise self._fail("creating directory", "", e) from e


# One TensorStore context per memory:// store name, so arrays written through TensorStore and
# objects written here see the same in-process bytes.
_MEMORY_CONTEXTS: dict[str, object] = {}
_MEMORY_LOCK = threading.Lock()


def memory_context(name: str):
    import tensorstore as ts

    with _MEMORY_LOCK:
        if name not in _MEMORY_CONTEXTS:
            _MEMORY_CONTEXTS[name] = ts.Context()
        return _MEMORY_CONTEXTS[name]


class MemoryObjectStore:
    """In-process store over TensorStore's ``memory`` kvstore (unit tests; one process only)."""

    def __init__(self, location: Location) -> None:
        import tensorstore as ts

        self.location = location
        self._kv = ts.KvStore.open({"driver": "memory"}, context=memory_context(location.bucket)).result()
        self._lock = threading.Lock()

    def _key(self, key: str) -> str:
        return self.location.join(key)

    def read(self, key: str) -> bytes | None:
        result = self._kv.read(self._key(key)).result()
        return result.value if result.state == "value" else None

    def write(self, key: str, data: bytes) -> None:
        self._kv.write(self._key(key), data).result()

    def write_if_absent(self, key: str, data: bytes) -> bool:
        with self._lock:
            stored = self.read(key)
            if stored is not None:
                return stored == data  # the other backends' rule: our own bytes count as ours
            self.write(key, data)
            return True

    def exists(self, key: str) -> bool:
        return self.read(key) is not None

    def _all(self, key: str) -> list[str]:
        import tensorstore as ts

        prefix = self._key(key)
        prefix = prefix + "/" if prefix else ""
        keys = self._kv.list(ts.KvStore.KeyRange(prefix, prefix + "\xff")).result()
        return [k.decode()[len(prefix) :] for k in keys]

    def list_children(self, key: str) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self._all(key)})

    def list_keys(self, key: str) -> list[str]:
        return sorted(self._all(key))

    def delete_prefix(self, key: str) -> None:
        import tensorstore as ts

        prefix = self._key(key)
        self._kv.delete_range(ts.KvStore.KeyRange(prefix + "/", prefix + "/\xff")).result()
        self._kv.write(prefix, None).result()

    def check_root(self, *, create: bool) -> None:
        if not create and not self._all(""):
            raise StorageError(f"no checkpoint data under {self.location.url!r} (memory store is empty)")
