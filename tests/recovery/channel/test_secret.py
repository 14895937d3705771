"""The job secret that keys heals across replica groups: env first, else one private run-dir file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient.errors import ConfigError
from resilient.recovery.channel.secret import SECRET_ENV, job_secret
from resilient.runfiles import JOB_KEY_FILE as KEY_FILE


@pytest.mark.timeout(10)
def test_run_dir_key_is_created_private_and_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    first = job_secret(str(tmp_path / "run"))
    assert len(first) == 32 and job_secret(str(tmp_path / "run")) == first  # every rank reads the same
    assert os.stat(tmp_path / "run" / KEY_FILE).st_mode & 0o777 == 0o600
    assert job_secret(str(tmp_path / "other")) != first


@pytest.mark.timeout(10)
def test_env_wins_and_bad_keys_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)
    assert job_secret(str(tmp_path)) == bytes.fromhex("ab" * 32)
    monkeypatch.setenv(SECRET_ENV, "abcd")
    with pytest.raises(ConfigError, match=SECRET_ENV):
        job_secret(str(tmp_path))
    monkeypatch.delenv(SECRET_ENV)
    job_secret(str(tmp_path))
    os.chmod(tmp_path / KEY_FILE, 0o644)
    with pytest.raises(ConfigError, match="readable by no one else"):
        job_secret(str(tmp_path))
