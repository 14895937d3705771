"""A bounded on-disk cache of the members a node reads from S3, shared by its processes.

A shard on S3 is read member by member (ranged GETs); every epoch would fetch the same bytes
again. The cache keeps them under ``data.cache_dir`` up to ``data.cache_bytes``, evicting the least
recently used first. Any process may read, write or evict at any time: a member is written to a
temp file and renamed into place (a reader sees all of it or nothing), a hit refreshes its mtime
(the LRU order), and a reader that loses a race with an eviction simply fetches again.

A cached member is trusted only if its crc32c still matches: the index has no checksums of its own,
and a member that decodes on one rank and not on another (a flipped bit on one node's disk) would
make the ranks skip different samples.
"""

from __future__ import annotations

import contextlib
import logging
import os

import crc32c

log = logging.getLogger(__name__)

EVICT_TO = 0.9
"""An eviction pass brings the cache down to this share of its budget (not to the edge, where every
next write would start another pass)."""


class MemberCache:
    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._written_since_scan = 0
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key)

    def get(self, key: str) -> bytes | None:
        """The member's bytes, or None (not cached, evicted meanwhile, or damaged: then removed)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            return None
        data, stored = blob[:-4], blob[-4:]
        if len(blob) < 4 or crc32c.crc32c(data).to_bytes(4, "little") != stored:
            log.warning("shard cache: %s is damaged; fetching it again", path)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        with contextlib.suppress(OSError):  # LRU: a hit is recent use
            os.utime(path)
        return data

    def put(self, key: str, data: bytes) -> None:
        """Keep ``data``; never raises (a full or read-only disk only costs the next fetch)."""
        path = self._path(key)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data + crc32c.crc32c(data).to_bytes(4, "little"))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("shard cache: cannot write %s (%s); reading from storage instead", path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        self._written_since_scan += len(data) + 4
        # Scan only when this process alone may have filled a tenth of the budget since its last
        # scan: a directory listing per member would cost more than the cache saves.
        if self._written_since_scan >= self.max_bytes * (1 - EVICT_TO):
            self.evict()

    def evict(self) -> int:
        """Remove the least recently used members until the cache is under ``EVICT_TO`` of its
        budget; returns the bytes it holds after. A killed writer's temp file is old, so it goes
        early; a live writer whose temp file goes anyway loses only that write."""
        self._written_since_scan = 0
        entries = []
        for root, _, names in os.walk(self.directory):
            for name in names:
                with contextlib.suppress(OSError):
                    stat = os.stat(os.path.join(root, name))
                    entries.append((stat.st_mtime, stat.st_size, os.path.join(root, name)))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return total
        for _, size, path in sorted(entries):
            if total <= self.max_bytes * EVICT_TO:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                total -= size
        return total
