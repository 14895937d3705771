"""storage/snapshot.py's StagingPool: a wait for a buffer says what it waited for."""

from __future__ import annotations

import pytest

from resilient.errors import QuorumTimeout, StagingTimeout, StorageError
from resilient.storage.snapshot import StagingPool


@pytest.mark.timeout(10)
def test_a_staging_buffer_wait_times_out_as_a_storage_error_naming_the_setting() -> None:
    pool = StagingPool(budget_bytes=1 << 20)
    held = pool.acquire(1 << 20, timeout_s=1.0)
    with pytest.raises(StagingTimeout, match=r"no staging buffer of 1\.0 MiB .*checkpoint\.staging_bytes") as info:
        pool.acquire(1 << 20, timeout_s=0.05)
    assert isinstance(info.value, StorageError) and isinstance(info.value, TimeoutError)
    assert not isinstance(info.value, QuorumTimeout)
    pool.release(held)
    assert pool.acquire(1 << 20, timeout_s=0.05) is held
