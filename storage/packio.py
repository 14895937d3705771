"""Writing a rank's packs (``pack.py``) to where the checkpoint lives, durable before the receipt.

- Local files: each pack created once (``O_EXCL``) and written in pieces at their offsets by
  ``io_threads`` threads, then the attempt made durable in one pass (``localwrite``).
- S3: a pack below ``MULTIPART_MIN_BYTES`` is one PUT; a bigger one a multipart upload whose parts
  go out on ``io_threads`` threads (S3 caps a single PUT at 5 GiB, and one stream over one
  connection is slower than several). The object exists only once the upload completes, so a
  kill leaves no partial pack, only an unfinished upload (a bucket lifecycle rule
  ``AbortIncompleteMultipartUpload`` reclaims those).
- memory:// (tests): one write through the object store.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from resilient.errors import StorageError
from resilient.faults import fault_point
from resilient.manifest import step_dir
from resilient.storage.localwrite import AttemptFiles
from resilient.storage.objects import ObjectStore
from resilient.storage.pack import Pack, PackBuilder, Ref, crc32_of, pack_name
from resilient.storage.parallel import run_parallel
from resilient.storage.url import Location

if TYPE_CHECKING:  # persist.py imports this module
    from resilient.storage.persist import PersistJob

MULTIPART_MIN_BYTES = 64 << 20
"""Packs from this size on are uploaded in parts (S3's minimum part is 5 MiB)."""
PART_BYTES = 32 << 20


def write_packs(packs: list[Pack], job: PersistJob, location: Location, store: ObjectStore) -> None:
    """Write every pack; returns once they are all durable. Fires ``persist.first_region_issued``
    once the first pack is out and ``persist.regions_written`` once all are, before durability."""
    if location.scheme == "file":
        _write_local(packs, job, location.url)
        return
    for n, pack in enumerate(packs):
        key = f"{job.attempt_key}/{pack.key}"
        if location.scheme == "s3" and pack.nbytes >= MULTIPART_MIN_BYTES:
            _upload_parts(location, store, key, pack.buffers(), job.io_threads)
        else:
            store.write(key, b"".join(pack.buffers()))
        if n == 0:
            fault_point("persist.first_region_issued")
    fault_point("persist.regions_written")


def _write_local(packs: list[Pack], job: PersistJob, root: str) -> None:
    if not packs:  # a rank with nothing to write (all its tensors written by a peer) makes nothing
        return  # durable; it must not fsync step-N/ either: the rank that creates it may not have yet
    files = AttemptFiles(root, expected_files=len(packs))
    files.sync_dirs_anyway(["", step_dir(job.step)])  # the root names step-N/, step-N/ the attempt
    try:
        for n, pack in enumerate(packs):
            key = f"{job.attempt_key}/{pack.key}"
            files.make_parent(key)
            files.write(key, pack.buffers(), threads=job.io_threads)
            if n == 0:
                fault_point("persist.first_region_issued")
        fault_point("persist.regions_written")
        files.make_durable(job.io_threads)
    finally:
        files.close()


def _upload_parts(location: Location, store: ObjectStore, key: str, buffers: list, threads: int) -> None:
    """One multipart upload of ``buffers`` back to back, ``PART_BYTES`` a part, parts in parallel."""
    from resilient.storage.s3 import s3_client

    client = s3_client(location)
    full_key = location.join(key)
    parts = _cut(buffers, PART_BYTES)
    try:
        upload = client.create_multipart_upload(Bucket=location.bucket, Key=full_key)["UploadId"]
    except Exception as e:
        raise StorageError(f"starting the upload of s3://{location.bucket}/{full_key} failed: {e}") from e
    etags: list[str | None] = [None] * len(parts)

    def put(n: int) -> None:
        got = client.upload_part(
            Bucket=location.bucket, Key=full_key, UploadId=upload, PartNumber=n + 1, Body=b"".join(parts[n])
        )
        etags[n] = got["ETag"]

    try:
        run_parallel([lambda n=n: put(n) for n in range(len(parts))], threads)
        client.complete_multipart_upload(
            Bucket=location.bucket,
            Key=full_key,
            UploadId=upload,
            MultipartUpload={"Parts": [{"ETag": t, "PartNumber": n + 1} for n, t in enumerate(etags)]},
        )
    except Exception as e:
        with contextlib.suppress(Exception):  # the upload's own error is the one to report
            client.abort_multipart_upload(Bucket=location.bucket, Key=full_key, UploadId=upload)
        raise StorageError(f"uploading s3://{location.bucket}/{full_key} failed: {e}") from e


def _cut(buffers: list, size: int) -> list[list[memoryview]]:
    """``buffers`` back to back, cut into parts of ``size`` bytes (the last one shorter)."""
    parts: list[list[memoryview]] = [[]]
    room = size
    for b in buffers:
        view = memoryview(b).cast("B")
        while view.nbytes:
            if not room:
                parts.append([])
                room = size
            piece = view[:room]
            parts[-1].append(piece)
            room -= piece.nbytes
            view = view[piece.nbytes :]
    return parts


class PackStream:
    """Packs written front to back as entries arrive, for writers that cannot hold a whole pack
    in memory (the offline tools). Each entry's CRC-32 is taken before its local header goes out;
    ``close`` writes each pack's central directory and makes it durable (local: fdatasync and the
    directories' fsync; S3: the multipart upload completes; memory://: one write)."""

    def __init__(self, location: Location, store: ObjectStore, attempt_key: str, rank: int = 0) -> None:
        self.location, self.store, self.attempt_key, self.rank = location, store, attempt_key, rank
        self._builder = PackBuilder(lambda index: pack_name(rank, index))
        self._out: _Out | None = None
        self._written = 0  # entries of the current pack already out

    def add(self, name: str, buffers: list) -> Ref:
        packs_before = len(self._builder.packs)
        ref = self._builder.add(name, buffers)
        pack = self._builder.packs[-1]
        if len(self._builder.packs) != packs_before or self._out is None:
            if self._out is not None:
                self._out.finish(self._builder.packs[-2].tail())
            self._out = _open_out(self.location, self.store, f"{self.attempt_key}/{pack.key}")
            self._written = 0
        entry = pack.entries[-1]
        entry.crc = crc32_of(entry.buffers)
        self._out.write(pack.header_of(entry) + list(entry.buffers))
        entry.buffers = []  # out: the caller's memory is free again
        return ref

    def close(self) -> None:
        if self._out is not None:
            out, self._out = self._out, None
            out.finish(self._builder.packs[-1].tail())

    def abort(self) -> None:
        """Give up the pack being written (after an error): its file closed, its multipart upload
        aborted. Never raises: the error that led here is the one to report. What was written
        stays an uncommitted attempt, which retention removes after a later commit."""
        if self._out is not None:
            out, self._out = self._out, None
            with contextlib.suppress(Exception):
                out.abort()


class _Out:
    def write(self, buffers: list) -> None: ...
    def finish(self, tail: list) -> None: ...
    def abort(self) -> None: ...


def _open_out(location: Location, store: ObjectStore, key: str) -> _Out:
    if location.scheme == "file":
        return _FileOut("/" + location.join(key))
    return _BufferedOut(location, store, key)


class _FileOut(_Out):
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path, self.fd = path, -1
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(f"cannot create {path}: {e.strerror}") from e

    def abort(self) -> None:
        """Close the file once: a second close of the same number would close whatever file
        another thread has opened since under it."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def write(self, buffers: list) -> None:
        try:
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                while view.nbytes:
                    view = view[os.write(self.fd, view) :]
        except OSError as e:
            self.abort()
            raise StorageError(f"writing {self.path} failed: {e.strerror}") from e

    def finish(self, tail: list) -> None:
        try:
            self.write(tail)
            os.fdatasync(self.fd)
        finally:
            self.abort()
        for directory in _parents(self.path, 3):  # the attempt, the step, the root: each gained an entry
            fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _parents(path: str, n: int) -> list[str]:
    out = []
    for _ in range(n):
        path = os.path.dirname(path)
        out.append(path)
    return out


class _BufferedOut(_Out):
    """S3: parts of ``PART_BYTES`` uploaded as they fill (a multipart upload once there is more
    than one); memory://: everything, written at the end."""

    def __init__(self, location: Location, store: ObjectStore, key: str) -> None:
        self.location, self.store, self.key = location, store, key
        self.pending = bytearray()
        self.upload: _Multipart | None = None

    def write(self, buffers: list) -> None:
        for buffer in buffers:
            self.pending += memoryview(buffer).cast("B")
        if self.location.scheme == "s3" and len(self.pending) >= PART_BYTES:
            self.upload = self.upload or _Multipart(self.location, self.key)
            self.upload.put(bytes(self.pending))
            self.pending.clear()

    def finish(self, tail: list) -> None:
        for buffer in tail:
            self.pending += memoryview(buffer).cast("B")
        if self.upload is None:
            self.store.write(self.key, bytes(self.pending))
        else:
            self.upload.put(bytes(self.pending))
            self.upload.complete()
        self.pending.clear()

    def abort(self) -> None:
        self.pending.clear()
        if self.upload is not None:
            upload, self.upload = self.upload, None
            upload.abort()


class _Multipart:
    """One multipart upload, parts put in order by the caller's thread."""

    def __init__(self, location: Location, key: str) -> None:
        from resilient.storage.s3 import s3_client

        self.client, self.bucket, self.key = s3_client(location), location.bucket, location.join(key)
        self.etags: list[str] = []
        try:
            self.id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        except Exception as e:
            raise StorageError(f"starting the upload of s3://{self.bucket}/{self.key} failed: {e}") from e

    def put(self, body: bytes) -> None:
        try:
            got = self.client.upload_part(
                Bucket=self.bucket, Key=self.key, UploadId=self.id, PartNumber=len(self.etags) + 1, Body=body
            )
        except Exception as e:
            self.abort()
            raise StorageError(f"uploading s3://{self.bucket}/{self.key} failed: {e}") from e
        self.etags.append(got["ETag"])

    def complete(self) -> None:
        parts = [{"ETag": t, "PartNumber": n + 1} for n, t in enumerate(self.etags)]
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=self.key, UploadId=self.id, MultipartUpload={"Parts": parts}
            )
        except Exception as e:
            self.abort()
            raise StorageError(f"completing the upload of s3://{self.bucket}/{self.key} failed: {e}") from e

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # the upload's own error is the one to report
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.id)
