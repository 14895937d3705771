"""The file-system writer: shard objects byte-identical to TensorStore's, every file and every new
directory durable before the receipt, writev of more buffers than IOV_MAX, errors surfaced."""

from __future__ import annotations

import ctypes
import errno
import os

import ml_dtypes
import numpy as np
import pytest
import torch

from resilient import Checkpointer
from resilient.errors import StorageError
from resilient.layout import Box
from resilient.manifest import FORMAT_VERSION
from resilient.storage import localwrite, persist
from resilient.storage.arrays import array_metadata, make_context, open_array
from resilient.storage.config import CheckpointerConfig
from resilient.storage.localwrite import AttemptFiles
from resilient.storage.parallel import run_parallel
from resilient.storage.shardfile import chunk_key, encode_shard, shards_in
from resilient.storage.url import parse_url

pytestmark = pytest.mark.timeout(120)

CASES = [  # shape, dtype, shard shape, inner shape: edges cut shards and inner chunks
    ((5, 3), "float32", (4, 3), (2, 3)),
    ((37, 11), "float32", (16, 11), (4, 11)),
    ((37, 11), "bfloat16", (16, 8), (8, 4)),
    ((9, 4, 5), "int64", (4, 4, 5), (2, 2, 5)),
    ((13,), "bool", (8,), (8,)),
    ((7,), "float16", (7,), (1,)),
    ((), "float32", (), ()),
    ((4096,), "float32", (4096,), (4096,)),  # one whole inner chunk per shard: encode_shard's short path
    ((6, 4), "bfloat16", (6, 4), (6, 4)),
]


def _data(shape, dtype):
    rng = np.random.default_rng(sum(shape) + len(dtype))
    if dtype == "bool":
        return rng.random(shape) > 0.5
    if dtype == "bfloat16":
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    return (rng.standard_normal(shape) * 100).astype(dtype)


@pytest.mark.parametrize("shape,dtype,shard,inner", CASES)
def test_shard_objects_are_byte_identical_to_tensorstores(tmp_path, shape, dtype, shard, inner):
    data = _data(shape, dtype)
    location = parse_url(str(tmp_path / "ts"))
    store = open_array(
        location,
        "a",
        array_metadata(list(shape), dtype, list(shard), list(inner), format_version=FORMAT_VERSION),
        make_context(location),
    )
    store.result().write(data).result()
    written = 0
    for index, box in shards_in(Box((0,) * len(shape), shape), shard):
        part = data[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes, strict=True))]
        ours = b"".join(bytes(memoryview(b).cast("B")) for b in encode_shard(part, shard, inner))
        with open(tmp_path / "ts" / "a" / chunk_key(index, format_version=FORMAT_VERSION), "rb") as f:
            assert ours == f.read(), f"shard {index} differs"
        written += 1
    stored = [n for _, _, names in os.walk(tmp_path / "ts" / "a") for n in names if n != "zarr.json"]
    assert written == len(stored)


def _record_syncs(monkeypatch) -> list[tuple[str, str]]:
    """Every fsync/fdatasync from here on, as ("sync", path of the fd)."""
    events: list[tuple[str, str]] = []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def path_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append(("sync", path_of(fd))), real_fdatasync(fd))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("sync", path_of(fd))), real_fsync(fd))[1])
    return events


def _durable_before(events: list[tuple[str, str]], mark: tuple[str, str], attempt) -> None:
    """Every file of ``attempt`` and every directory from it up to the root synced before ``mark``."""
    at = events.index(mark)
    synced_before = {p for kind, p in events[:at] if kind == "sync"}
    # the step directory names the attempt, the root names the step: both synced whoever made them
    # (review: a failed earlier attempt may have created step-N/ and died before syncing the root)
    files, dirs = set(), {str(attempt.parent), str(attempt.parent.parent)}
    for root, subdirs, names in os.walk(attempt):
        subdirs[:] = [d for d in subdirs if d != "receipts"]
        files.update(os.path.join(root, n) for n in names)
        dirs.add(root)
    assert files and files <= synced_before, sorted(files - synced_before)
    assert dirs <= synced_before, sorted(dirs - synced_before)


_DURABLE_STATE = {"model": {"w": torch.randn(64, 32), "b": torch.randn(32), "deep": {"x": torch.arange(6)}}}


def test_every_file_and_every_new_directory_is_durable_before_the_manifest(tmp_path, monkeypatch):
    """Rank 0, the coordinator, writes no receipt (its own goes to the commit in memory): its
    packs are durable before the manifest, the commit point."""
    from resilient.storage import objects

    events = _record_syncs(monkeypatch)
    real_create = objects.FileObjectStore.write_if_absent
    monkeypatch.setattr(
        objects.FileObjectStore,
        "write_if_absent",
        lambda self, key, data: (events.append(("create", key)), real_create(self, key, data))[1],
    )
    monkeypatch.setattr(persist, "write_receipt", lambda *a, **k: events.append(("receipt", "")))
    Checkpointer(str(tmp_path / "ck")).save(1, _DURABLE_STATE).wait()

    assert ("receipt", "") not in events
    attempt = next(p for p in (tmp_path / "ck" / "step-000000001").iterdir() if p.name.startswith("attempt-"))
    _durable_before(events, ("create", "step-000000001/manifest.json"), attempt)


def test_a_non_coordinator_rank_is_durable_before_its_receipt(tmp_path, monkeypatch):
    """Ranks > 0 still report through a receipt, written once their packs are durable: the job of
    a one-process save, persisted as rank 1 of 2 (the coordinator's decision stubbed)."""
    from resilient.storage import workers

    jobs: list = []
    monkeypatch.setattr(workers.PersistThread, "submit", lambda self, job, buffer, *rest: jobs.append((job, buffer)))
    ckpt = Checkpointer(str(tmp_path / "ck"))
    ckpt.save(1, _DURABLE_STATE)
    (job, buffer), location = jobs[0], ckpt.location
    job.rank, job.world_size = 1, 2
    events = _record_syncs(monkeypatch)
    monkeypatch.setattr(persist, "wait_for_commit", lambda job, store: events.append(("decided", "")))
    real_receipt = persist.write_receipt
    monkeypatch.setattr(
        persist, "write_receipt", lambda *a, **k: (events.append(("receipt", "")), real_receipt(*a, **k))[1]
    )
    persist.run_persist(job, buffer.data, location, ckpt.store, None)

    assert [e for e in events if e[0] != "sync"] == [("receipt", ""), ("decided", "")]
    attempt = tmp_path / "ck" / "step-000000001" / job.attempt
    assert sorted(p.name for p in attempt.iterdir()) == ["pack-r00001-0.zip", "receipts"]
    _durable_before(events, ("receipt", ""), attempt)


def test_writev_resumes_across_more_buffers_than_iov_max(tmp_path):
    buffers = [bytes([i % 256]) * (1 + i % 7) for i in range(3 * localwrite.IOV_MAX + 5)]
    files = AttemptFiles(str(tmp_path), expected_files=1)
    files.make_dirs(["a/b/obj"])
    assert files.write("a/b/obj", buffers) == sum(len(b) for b in buffers)
    assert (tmp_path / "a" / "b" / "obj").read_bytes() == b"".join(buffers)


def test_writeback_starts_piece_by_piece_as_a_big_file_is_written(tmp_path, monkeypatch):
    """The kernel is asked to write each WRITEBACK_STEP_BYTES as it lands (so the disk works while
    the rest is copied), and any tail of WRITEBACK_MIN_BYTES or more; tiny files are left to the
    durability pass. The file's bytes are those given, whatever the cuts."""
    monkeypatch.setattr(localwrite, "WRITEBACK_STEP_BYTES", 1 << 16)
    monkeypatch.setattr(localwrite, "WRITEBACK_MIN_BYTES", 1 << 12)
    ranges: list[tuple[int, int]] = []
    real = localwrite.start_writeback
    monkeypatch.setattr(localwrite, "start_writeback", lambda fd, o, n: (ranges.append((o, n)), real(fd, o, n)))
    rng = np.random.default_rng(0)
    # one buffer bigger than a step, many small ones, one that straddles a step's end
    buffers = [rng.bytes(150_000)] + [rng.bytes(1000) for _ in range(70)] + [rng.bytes(70_001)]
    files = AttemptFiles(str(tmp_path), expected_files=localwrite.SYNCFS_MIN_FILES)
    files.make_dirs(["big", "tiny"])
    size = files.write("big", buffers)
    files.write("tiny", [b"x" * 100])
    assert size == sum(map(len, buffers)) == (tmp_path / "big").stat().st_size
    assert (tmp_path / "big").read_bytes() == b"".join(buffers)
    step = 1 << 16
    whole, tail = divmod(size, step)
    assert ranges == [(i * step, step) for i in range(whole)] + [(whole * step, tail)]  # the tiny file: none
    files.close()


def test_an_io_error_starting_writeback_fails_the_write_and_unsupported_is_ignored(tmp_path, monkeypatch):
    def failing(code):
        def sync_file_range(fd, offset, nbytes, flags):
            ctypes.set_errno(code)
            return -1

        return sync_file_range

    big = [b"x" * (2 << 20)]
    files = AttemptFiles(str(tmp_path), expected_files=1)
    monkeypatch.setattr(localwrite, "_SYNC_FILE_RANGE", failing(errno.EINVAL))  # e.g. a pipe, a FUSE mount
    assert files.write("ignored", big) == 2 << 20
    monkeypatch.setattr(localwrite, "_SYNC_FILE_RANGE", failing(errno.EIO))
    with pytest.raises(StorageError, match="writing .*/failed.* failed: Input/output error"):
        files.write("failed", big)


def _many_files(root, monkeypatch=None) -> AttemptFiles:
    files = AttemptFiles(str(root), expected_files=localwrite.SYNCFS_MIN_FILES)
    for i in range(localwrite.SYNCFS_MIN_FILES):
        files.make_parent(f"d{i % 3}/f{i}")
        files.write(f"d{i % 3}/f{i}", [bytes([i]) * 10])
    return files


def test_syncfs_checks_an_fd_opened_before_the_first_write(tmp_path, monkeypatch):
    """syncfs reports a writeback error to an fd opened before the error (errseq), even if another
    process's syncfs has seen it since: the fd must predate every write, and be closed after."""
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1])
    synced_fds: list[int] = []
    real_syncfs = localwrite._SYNCFS
    monkeypatch.setattr(localwrite, "_SYNCFS", lambda fd: (synced_fds.append(fd), real_syncfs(fd))[1])
    files = _many_files(tmp_path)
    files.make_durable(4)
    first_file = next(i for i, p in enumerate(opened) if p.endswith("/f0"))
    assert str(tmp_path) in opened[:first_file], "the fd syncfs uses is opened before the first file"
    assert len(synced_fds) == 1
    with pytest.raises(OSError):
        os.fstat(synced_fds[0])  # closed once the pass is done


def test_a_pack_is_written_in_pieces_at_their_offsets_by_several_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(localwrite, "WRITEBACK_STEP_BYTES", 1 << 16)
    offsets: list[int] = []
    real_pwritev = os.pwritev

    def spy(fd, views, offset):
        offsets.append(offset)
        return real_pwritev(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", spy)
    rng = np.random.default_rng(1)
    buffers = [rng.bytes(int(n)) for n in rng.integers(1, 40_000, size=300)]
    files = AttemptFiles(str(tmp_path), expected_files=1)
    assert files.write("pack", buffers, threads=4) == sum(map(len, buffers))
    files.make_durable(4)
    assert (tmp_path / "pack").read_bytes() == b"".join(buffers)
    assert len(offsets) > 1 and offsets[0] == 0  # in pieces, each at its offset (tasks of run_parallel)


def test_the_first_region_fault_point_fires_once_after_the_first_pack_is_out(tmp_path, monkeypatch):
    """Chaos pauses and kills at persist.first_region_issued: it must mean "data is out"."""
    from resilient.storage import packio

    writes: list[str] = []
    fired_after: list[int] = []
    real_write = AttemptFiles.write
    monkeypatch.setattr(
        AttemptFiles, "write", lambda self, key, buffers, **k: writes.append(key) or real_write(self, key, buffers, **k)
    )
    monkeypatch.setattr(
        packio, "fault_point", lambda name: fired_after.append(len(writes)) if name.endswith("issued") else None
    )
    state = {"a_big": torch.randn(512, 512)} | {f"norm{i}": torch.randn(16) for i in range(20)}
    with Checkpointer(str(tmp_path / "ck"), config=CheckpointerConfig(io_threads=1)) as ckpt:
        ckpt.save(1, state).wait()
    assert fired_after == [1], "fired once, right after the first pack was written"


def test_a_file_is_created_once_never_overwritten(tmp_path):
    files = AttemptFiles(str(tmp_path), expected_files=1)
    files.make_dirs(["k"])
    files.write("k", [b"first"])
    with pytest.raises(StorageError, match="cannot create .*k"):
        files.write("k", [b"second"])
    assert (tmp_path / "k").read_bytes() == b"first"


def test_run_parallel_runs_every_task_and_raises_the_first_failure():
    done = []
    run_parallel([lambda i=i: done.append(i) for i in range(50)], threads=4)
    assert sorted(done) == list(range(50))

    def boom() -> None:
        raise StorageError("disk full")

    with pytest.raises(StorageError, match="disk full"):
        run_parallel([boom] + [lambda: None] * 10, threads=3)


def test_many_files_are_made_durable_by_one_syncfs(tmp_path, monkeypatch):
    events: list[str] = []
    real_syncfs = localwrite._SYNCFS
    assert real_syncfs is not None, "this Linux has syncfs"
    monkeypatch.setattr(localwrite, "_SYNCFS", lambda fd: (events.append("syncfs"), real_syncfs(fd))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: events.append("fdatasync"))
    files = _many_files(tmp_path)
    if not files.use_syncfs:
        pytest.skip("syncfs is not trusted on this file system")
    files.make_durable(4)
    assert events == ["syncfs"]


def test_a_failed_syncfs_fails_the_durability_pass(tmp_path, monkeypatch):
    def eio(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    files = _many_files(tmp_path)
    if not files.use_syncfs:
        pytest.skip("syncfs is not trusted on this file system")
    monkeypatch.setattr(localwrite, "_SYNCFS", eio)
    with pytest.raises(StorageError, match="syncfs.*Input/output error"):
        files.make_durable(4)


def test_syncfs_is_trusted_only_on_local_file_systems(tmp_path):
    assert localwrite._fs_type("/proc/self") == "proc"
    assert not localwrite.syncfs_is_trusted("/proc/self")  # not a local disk file system
    local = localwrite._fs_type(str(tmp_path)) in localwrite.TRUSTED_SYNCFS_TYPES
    assert localwrite.syncfs_is_trusted(str(tmp_path)) == (local and localwrite._kernel_at_least(5, 8))
    few, many = (AttemptFiles(str(tmp_path), expected_files=n) for n in (1, localwrite.SYNCFS_MIN_FILES))
    assert not few.use_syncfs and many.use_syncfs == localwrite.syncfs_is_trusted(str(tmp_path))
    many.close()


@pytest.mark.timeout(30)
def test_run_parallel_interrupted_while_waiting_leaves_no_task_running():
    # A load's tasks write into the caller's tensors: none may run after run_parallel has raised.
    import signal
    import time

    events: list[tuple[str, float]] = []

    def task(i: int) -> None:
        if i == 0:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches the main thread, waiting in join
        time.sleep(0.05)
        events.append(("done", time.monotonic()))

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_parallel(((lambda i=i: task(i)) for i in range(200)), 4)
        raised_at = time.monotonic()
    finally:
        signal.signal(signal.SIGINT, previous)
    time.sleep(0.3)
    assert len(events) < 200 and all(t <= raised_at for _, t in events)


def test_a_failed_pack_stream_write_closes_its_file_exactly_once(tmp_path, monkeypatch):
    # A second close of the same number would close whatever file another thread opened since.
    from resilient.storage import packio
    from resilient.storage.objects import open_store

    location = parse_url(str(tmp_path / "root"))
    stream = packio.PackStream(location, open_store(location), "step-000000001/attempt-a")
    stream.add("a/0", [b"x" * 10])
    fd, closed, real_close = stream._out.fd, [], os.close
    monkeypatch.setattr(packio.os, "close", lambda n: (closed.append(n), real_close(n))[1])

    def full(n, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packio.os, "write", full)
    with pytest.raises(StorageError, match="No space left on device"):
        stream.add("a/1", [b"y"])
    with pytest.raises(StorageError, match="failed"):
        stream.close()  # the pack's tail cannot go out either, and its file is not closed again
    stream.abort()
    assert closed.count(fd) == 1


def test_an_aborted_pack_stream_leaves_no_multipart_upload_on_s3(s3_bucket, s3_endpoint, monkeypatch):
    import boto3

    from resilient.storage import packio
    from resilient.storage.objects import open_store

    monkeypatch.setattr(packio, "PART_BYTES", 1 << 10)  # a multipart upload after the first KiB
    location = parse_url(f"s3://{s3_bucket}/run", {"endpoint_url": s3_endpoint})
    stream = packio.PackStream(location, open_store(location), "step-000000001/attempt-a")
    stream.add("a/0", [bytes(4 << 10)])
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    assert len(client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])) == 1
    stream.abort()
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
