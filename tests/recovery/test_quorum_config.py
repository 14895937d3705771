"""``[replica]`` validation and the launcher's argument checks (no processes started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.errors import ConfigError
from resilient.recovery.config import ReplicaConfig, check_rows_divisible
from resilient.recovery.quorum import replica_name
from resilient.trainer.config import load_config

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


def test_defaults_retry_the_lighthouse() -> None:
    config = ReplicaConfig()
    assert not config.enabled and config.quorum_retries >= 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quorum_retries": 0}, r"replica.quorum_retries=0"),
        ({"groups": 0}, r"replica.groups=0"),
        ({"groups": 2, "min_replica_size": 3}, r"replica.min_replica_size=3"),
        ({"lighthouse": "127.0.0.1:1"}, r"http://HOST:PORT"),
        ({"quorum_timeout_s": 0.1}, r"replica.quorum_timeout_s=0.1"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReplicaConfig(**kwargs)


def test_lighthouse_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="no lighthouse"):
        ReplicaConfig(enabled=True).lighthouse_url()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:9")
    assert ReplicaConfig(enabled=True).lighthouse_url() == "http://127.0.0.1:9"


def test_rows_must_split_over_every_participant_count() -> None:
    check_rows_divisible(8, 2, 2)
    with pytest.raises(ConfigError, match=r"global_rows=8 .* not for \[3\]: make global_rows a multiple of 12"):
        check_rows_divisible(8, 2, 3)
    with pytest.raises(ConfigError, match="replica.groups=3"):
        load_config(TINY, ["replica.enabled=true", "replica.groups=3"])


def test_replica_section_is_off_by_default() -> None:
    assert not load_config(TINY).replica.enabled
    assert load_config(TINY, ["replica.groups=3"]).replica.groups == 3  # off: not checked


def test_replica_ids_sort_numerically() -> None:
    assert sorted([replica_name(10), replica_name(2)]) == [replica_name(2), replica_name(10)]
