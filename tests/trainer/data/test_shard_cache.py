"""The bounded on-disk cache of S3 shard members (trainer/data/shards/cache.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from resilient.trainer.data.shards.cache import EVICT_TO, MemberCache

pytestmark = pytest.mark.timeout(30)


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_a_member_comes_back_whole_and_a_damaged_one_is_refetched(tmp_path: Path) -> None:
    cache = MemberCache(str(tmp_path), max_bytes=1 << 20)
    cache.put("shard-000000.tar-512-5", b"hello")
    assert cache.get("shard-000000.tar-512-5") == b"hello" and cache.get("missing") is None
    path = tmp_path / "shard-000000.tar-512-5"
    damaged = bytearray(path.read_bytes())
    damaged[1] ^= 0x01  # a bit flipped on this node's disk: this rank would decode other bytes
    path.write_bytes(bytes(damaged))
    assert cache.get("shard-000000.tar-512-5") is None and not path.exists()


def test_the_cache_stays_within_its_budget_and_evicts_the_least_recently_used(tmp_path: Path) -> None:
    cache = MemberCache(str(tmp_path), max_bytes=5_000)  # 4 members of 1000 (+4 crc) bytes fit
    now = time.time()
    for i in range(4):
        cache.put(f"m{i}", bytes(1000))
        os.utime(tmp_path / f"m{i}", (now - 100 + i, now - 100 + i))  # m0 oldest ... m3 newest
    assert _size(tmp_path) == 4016
    assert cache.get("m0") == bytes(1000)  # a hit: m0 is now the most recently used
    cache.put("m4", bytes(1000))  # 5020 > 5000: down to <= 4500 by dropping the oldest, m1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0", "m2", "m3", "m4"]
    for i in range(5, 40):
        cache.put(f"m{i}", bytes(1000))
        assert _size(tmp_path) <= 5_000
    assert cache.evict() == _size(tmp_path) <= 5_000 * EVICT_TO + 1004


def test_an_unwritable_cache_costs_a_fetch_never_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = MemberCache(str(tmp_path / "dir"), max_bytes=1000)
    os.rmdir(tmp_path / "dir")
    (tmp_path / "dir").symlink_to(blocker)  # the cache folder is now a file
    cache.put("a", b"data")
    assert cache.get("a") is None
