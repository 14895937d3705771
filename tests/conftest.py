"""Shared fixtures: a real S3 endpoint on loopback (moto's server mode), and a scratch root."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from resilient.dist import free_port


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited early with code {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"moto_server did not listen on 127.0.0.1:{port} within {timeout_s} s")


@pytest.fixture(scope="session", autouse=True)
def _peak_cache(tmp_path_factory: pytest.TempPathFactory):
    """Trainers cache the measured peak FLOP/s per machine; tests keep it out of the developer's home
    (each pytest process its own file: xdist workers do not race on one), subprocesses included."""
    saved = os.environ.get("RESILIENT_PEAK_CACHE")
    os.environ["RESILIENT_PEAK_CACHE"] = str(tmp_path_factory.mktemp("peak") / "peak.json")
    yield
    if saved is None:
        os.environ.pop("RESILIENT_PEAK_CACHE", None)
    else:
        os.environ["RESILIENT_PEAK_CACHE"] = saved


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real HTTP S3 endpoint on 127.0.0.1, in its own process (not a mocked client)."""
    port = free_port()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint
    )
    try:
        _wait_for_port(port, proc)
        yield endpoint
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the loopback endpoint; yields its name."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name
