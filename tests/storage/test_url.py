"""Checkpoint root URLs: a URL with a slash missing is an error, not a local directory named 's3:'."""

from __future__ import annotations

import os

import pytest

from resilient.errors import ConfigError
from resilient.storage.url import parse_url
from resilient.trainer.config import load_config

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("url", ["s3:/bucket/x", "s3:bucket/x", "S3:/b/x", "file:/tmp/x", "memory:x", "gs:/b/x"])
def test_a_url_without_its_two_slashes_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=r"looks like a URL without '://'") as err:
        parse_url(url)
    assert repr(url) in str(err.value)


@pytest.mark.parametrize("path", ["runs/x", "/tmp/a:b/c", "./s3/x", "C:/x", "ckpt-2024-01-01T10:00"])
def test_local_paths_stay_local_paths(path: str) -> None:
    location = parse_url(path)
    assert location.scheme == "file" and location.url == os.path.abspath(path)


def test_the_trainer_refuses_it_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint.url: 's3:/x' looks like a URL without"):
        load_config(None, ["checkpoint.url=s3:/x"])
