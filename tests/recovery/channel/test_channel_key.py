"""The RAM channel key: derived on every rank from the job secret, never sent over the process group."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest
import torch.distributed as dist

from resilient.errors import ConfigError
from resilient.recovery.channel import secret
from resilient.recovery.channel.secret import SECRET_ENV, shared_secret


@pytest.mark.timeout(10)
def test_key_is_derived_per_group_and_never_broadcast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_broadcast(*args: object, **kwargs: object) -> None:
        raise AssertionError("the channel key must not be sent")

    monkeypatch.setattr(dist, "broadcast", no_broadcast)
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)
    key = shared_secret(str(tmp_path), 0)
    expected = hmac.new(bytes.fromhex("ab" * 32), b"resilient/ram/v1/group/0", hashlib.sha256).digest()
    assert key == expected and shared_secret(str(tmp_path), 0) == key  # every rank derives the same
    assert shared_secret(str(tmp_path), 1) != key  # each group its own key
    assert key != bytes.fromhex("ab" * 32)  # not the heal channel's key
    monkeypatch.delenv(SECRET_ENV)
    from_file = shared_secret(str(tmp_path / "run"), 0)
    assert len(from_file) == 32 and from_file == shared_secret(str(tmp_path / "run"), 0)


@pytest.mark.timeout(10)
def test_ranks_with_another_job_secret_fail_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)
    # Rank 1 of a two-rank group derived its key from another secret (its own node's job.key).
    monkeypatch.setattr(secret.rdist, "agree", lambda fn, **kw: [fn(), "0" * 16])
    with pytest.raises(ConfigError, match=r"ranks \[1\] hold another job secret.*RESILIENT_JOB_SECRET"):
        shared_secret(str(tmp_path), 0)
