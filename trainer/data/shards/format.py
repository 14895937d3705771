"""Reading a media shard build (docs/shards.md, version 1): the manifest, the shard indexes, and
one member of one sample with one range read.

A ``ShardSet`` holds the whole catalogue (every sample's member offsets and token counts) in
memory, so the trainer can plan packing without touching a tar. It pickles without its open
file descriptors or boto3 client: a DataLoader worker process gets a copy and opens its own on
first use (a boto3 client does not pickle, and one shared across ``fork`` is not safe).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resilient.errors import ConfigError, IntegrityError, StorageError
from resilient.storage.url import Location, parse_url
from resilient.trainer.data.shards.cache import MemberCache

if TYPE_CHECKING:
    import tokenizers

FORMAT = "resilient-media-shards"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SKIPPED = "skipped.jsonl"
TEXT_EXT = "json"
"""The member holding a sample's normalized text."""

S3_READ_RETRIES = 3
"""Retries of a failed GetObject before a StorageError. botocore retries the request itself, but
not a body that breaks off while it streams in (IncompleteRead, a read timeout): these do."""
S3_BACKOFF_S = 0.2
"""First wait between two tries of a range read (doubling)."""


def shard_tar_name(shard: int) -> str:
    return f"shard-{shard:06d}.tar"


def shard_index_name(shard: int) -> str:
    return f"shard-{shard:06d}.json"


def fingerprint_of(index_files: list[bytes], tokenizer_json: bytes) -> str:
    """sha256 over the shard index files (in shard order), then tokenizer.json: it changes iff
    what a trainer would read (sample set, offsets, token counts, vocabulary) changes."""
    digest = hashlib.sha256()
    for data in index_files:
        digest.update(data)
    digest.update(tokenizer_json)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class SampleEntry:
    """One sample as its shard index describes it."""

    key: str
    shard: int
    """Position of its shard in the manifest's ``shards`` list."""
    members: dict[str, tuple[int, int]]
    """Member extension -> (byte offset of its data in the tar, size)."""
    video: str | None
    """Extension of the member holding the video stream, or None."""
    audio: str | None
    """Extension of the member holding the audio stream, or None."""
    duration_s: float
    lead_tokens: int
    """Tokens of the untimed text."""
    segments: tuple[tuple[float, float, int], ...]
    """(start s, end s, tokens) of each timed text segment, sorted by start."""


def _entry(raw: dict, shard: int) -> SampleEntry:
    text = raw["text"]
    return SampleEntry(
        key=raw["key"],
        shard=shard,
        members={ext: (int(where[0]), int(where[1])) for ext, where in raw["members"].items()},
        video=raw["video"],
        audio=raw["audio"],
        duration_s=float(raw["duration_s"]),
        lead_tokens=int(text["lead_tokens"]),
        segments=tuple((float(s), float(e), int(n)) for s, e, n in text["segments"]),
    )


class ShardSet:
    """A finished build under a local folder or ``s3://bucket/prefix``. Open it with ``open``."""

    def __init__(self, store: _Store, manifest: dict, samples: list[SampleEntry], tokenizer_json: bytes) -> None:
        self.cache: MemberCache | None = None
        """Members read from S3 are kept here when set (``use_cache``)."""
        self.manifest = manifest
        self.fingerprint: str = manifest["fingerprint"]
        self.vocab_size: int = int(manifest["tokenizer"]["vocab_size"])
        self.samples = samples
        self._store = store
        self._tars: list[str] = [s["tar"] for s in manifest["shards"]]
        self._tokenizer_json = tokenizer_json

    @property
    def url(self) -> str:
        return self._store.location.url

    @classmethod
    def open(cls, dest: str) -> ShardSet:
        """Read the manifest and every shard index; ConfigError if DEST holds no finished build,
        IntegrityError if the indexes or tokenizer do not match the manifest's fingerprint."""
        location = parse_url(dest)
        if location.scheme not in ("file", "s3"):
            raise ConfigError(f"shard set {dest!r}: only a local folder or s3://bucket/prefix can hold shards")
        store = _Store(location)
        manifest = _read_manifest(store, dest)
        indexes = [store.read_whole(s["index"]) for s in manifest["shards"]]
        tokenizer_json = store.read_whole(manifest["tokenizer"]["file"])
        if fingerprint_of(indexes, tokenizer_json) != manifest["fingerprint"]:
            raise IntegrityError(
                f"shard set {location.url}: the shard indexes or tokenizer.json do not match the manifest's "
                "fingerprint (files replaced or damaged after the build); rebuild it with resilient-data build"
            )
        samples = [_entry(raw, shard) for shard, data in enumerate(indexes) for raw in json.loads(data)["samples"]]
        return cls(store, manifest, samples, tokenizer_json)

    def use_cache(self, directory: str, max_bytes: int) -> None:
        """Keep members read from S3 in a bounded cache under ``directory`` (a local build needs none)."""
        if self._store.location.scheme == "s3" and max_bytes > 0:
            self.cache = MemberCache(os.path.join(directory, self.fingerprint[:16]), max_bytes)

    def read_member(self, sample: SampleEntry, ext: str) -> bytes:
        """The bytes of ``<key>.<ext>``: from the cache, else with one range read (then cached)."""
        if ext not in sample.members:
            raise KeyError(f"sample {sample.key!r} has no member .{ext} (it has: {', '.join(sample.members)})")
        offset, size = sample.members[ext]
        tar = self._tars[sample.shard]
        key = f"{tar}-{offset}-{size}"
        cached = self.cache.get(key) if self.cache is not None else None
        if cached is not None:
            return cached
        data = self._store.read_range(tar, offset, size, f"sample {sample.key!r}")
        if self.cache is not None:
            self.cache.put(key, data)
        return data

    def text(self, sample: SampleEntry) -> dict:
        """``{"text": str, "segments": [{"start", "end", "text"}]}`` of the sample."""
        return json.loads(self.read_member(sample, TEXT_EXT))

    def tokenizer(self) -> tokenizers.Tokenizer:
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self._tokenizer_json.decode())

    def close(self) -> None:
        """Close this process's file descriptors (the S3 client needs no closing)."""
        self._store.close()


def _read_manifest(store: _Store, dest: str) -> dict:
    try:
        manifest = json.loads(store.read_whole(MANIFEST))
    except (StorageError, ValueError) as e:
        raise ConfigError(
            f"shard set {dest!r}: no readable {MANIFEST} ({_one_line(e)}); point at the --out of a finished "
            "`resilient-data build` (a build writes its manifest last)"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"shard set {dest!r}: {MANIFEST} is not a {FORMAT} manifest; point at a shard build")
    if manifest.get("version") != VERSION:
        raise ConfigError(
            f"shard set {dest!r}: format version {manifest.get('version')!r}, this reader knows {VERSION}; "
            "rebuild the shards with this resilient-data or update resilient"
        )
    return manifest


class _Store:
    """Whole-file and range reads under a build's location. File descriptors and the boto3 client
    are made on first use in each process and never pickled: a forked or spawned DataLoader worker
    opens its own (neither an fd's offset-free pread nor a boto3 client is worth sharing across
    fork, and a client does not pickle at all)."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self._reset()

    def __getstate__(self) -> dict:
        return {"location": self.location}

    def __setstate__(self, state: dict) -> None:
        self.location = state["location"]
        self._reset()

    def _reset(self) -> None:
        self._fds: dict[str, int] = {}
        self._client = None
        self._pid = os.getpid()
        self._opening = threading.Lock()  # two threads' first reads of a shard open one fd, not two

    def _own_handles(self) -> None:
        """A forked child inherits the parent's handles: start afresh rather than share them."""
        if self._pid != os.getpid():
            self._reset()

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._reset()

    def _path(self, name: str) -> str:
        return "/" + self.location.join(name)

    def read_whole(self, name: str) -> bytes:
        if self.location.scheme == "s3":
            return self._s3_get(name, None, f"reading {name}")
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except OSError as e:
            raise StorageError(f"reading {self._path(name)} failed: {e.strerror or e}") from e

    def read_range(self, name: str, offset: int, size: int, what: str) -> bytes:
        """``size`` bytes at ``offset`` of ``name``, in one read; ``what`` names them in errors."""
        if size == 0:
            return b""  # an empty byte range cannot be asked of S3
        if self.location.scheme == "s3":
            data = self._s3_get(name, (offset, offset + size - 1), f"reading {what} from {name}")
        else:
            data = self._pread(name, offset, size, what)
        if len(data) != size:
            raise StorageError(
                f"reading {what} from {self.location.url}/{name}: {len(data)} of {size} bytes at offset {offset} "
                "(the tar is shorter than its index says: truncated?); rebuild the shards"
            )
        return data

    def _pread(self, name: str, offset: int, size: int, what: str) -> bytes:
        self._own_handles()
        try:
            fd = self._fds.get(name)
            if fd is None:
                with self._opening:
                    fd = self._fds.get(name)
                    if fd is None:
                        fd = self._fds[name] = os.open(self._path(name), os.O_RDONLY)
            return os.pread(fd, size, offset)
        except OSError as e:
            raise StorageError(f"reading {what} from {self._path(name)} failed: {e.strerror or e}") from e

    def _s3_get(self, name: str, byte_range: tuple[int, int] | None, what: str) -> bytes:
        """One GetObject, retried S3_READ_RETRIES times with doubling waits (botocore bounds each
        try with its connect/read timeouts); an answer a retry cannot change is not retried."""
        self._own_handles()
        if self._client is None:
            from resilient.storage.s3 import s3_client

            with self._opening:
                if self._client is None:
                    self._client = s3_client(self.location)
        extra = {"Range": f"bytes={byte_range[0]}-{byte_range[1]}"} if byte_range else {}
        delay, last = S3_BACKOFF_S, None
        for attempt in range(1 + S3_READ_RETRIES):
            if attempt:
                time.sleep(delay)
                delay *= 2
            try:
                reply = self._client.get_object(Bucket=self.location.bucket, Key=self.location.join(name), **extra)
                return reply["Body"].read()
            except Exception as e:  # botocore's ClientError, connection and read-timeout errors alike
                last = e
                if _error_code(e) in _FINAL_CODES:
                    break
        raise StorageError(
            f"{what} at {self.location.url}/{name} failed after {attempt + 1} tries: {_one_line(last)}; "
            "check the endpoint, credentials and that the build finished"
        ) from last


_FINAL_CODES = {"NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidRange", "403", "404", "416"}
"""S3 answers a retry cannot change."""


def _error_code(err: Exception) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _one_line(err: BaseException | None) -> str:
    return " ".join(str(err).split()) or type(err).__name__
