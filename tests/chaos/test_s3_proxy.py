"""The fault proxy in front of a real moto server: transparent when idle, then 503 SlowDown,
connection resets and latency while a window is open."""

from __future__ import annotations

import time

import boto3
import botocore.config
import botocore.exceptions
import pytest

from resilient.chaos.s3_proxy import FaultProxy, MotoServer

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def proxied():
    moto = MotoServer()
    proxy = FaultProxy(moto.url, seed=1)
    try:
        moto.create_bucket("bkt")
        no_retries = botocore.config.Config(retries={"max_attempts": 1, "mode": "standard"})
        client = boto3.client(
            "s3",
            endpoint_url=proxy.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=no_retries,
        )
        yield proxy, client
    finally:
        proxy.close()
        moto.close()


def test_proxy_forwards_then_injects_errors_resets_and_latency(proxied) -> None:
    proxy, client = proxied
    client.put_object(Bucket="bkt", Key="k", Body=b"x" * 100_000)
    assert client.get_object(Bucket="bkt", Key="k")["Body"].read() == b"x" * 100_000
    assert client.head_object(Bucket="bkt", Key="k")["ContentLength"] == 100_000
    assert proxy.counts["requests"] == 3 and proxy.counts["errors"] == 0

    proxy.add_window("errors", 2.0, rate=1.0)
    with pytest.raises(botocore.exceptions.ClientError) as err:
        client.get_object(Bucket="bkt", Key="k")
    assert err.value.response["Error"]["Code"] == "SlowDown"
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert proxy.counts["errors"] >= 1
    time.sleep(2.1)  # the window closed: transparent again
    assert client.get_object(Bucket="bkt", Key="k")["Body"].read()[:3] == b"xxx"

    proxy.add_window("resets", 1.0, rate=1.0)
    with pytest.raises((botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        client.get_object(Bucket="bkt", Key="k")
    assert proxy.counts["resets"] >= 1
    time.sleep(1.1)

    proxy.add_window("latency", 2.0, delay_s=0.4)
    start = time.monotonic()
    client.head_object(Bucket="bkt", Key="k")
    assert time.monotonic() - start >= 0.4 and proxy.counts["delayed"] == 1
