"""The fault proxy in front of a real moto server: transparent when idle, then 503 SlowDown,
connection resets, latency and lost answers of writes that landed while a window is open."""

from __future__ import annotations

import time

import boto3
import botocore.config
import botocore.exceptions
import pytest

from resilient.chaos.s3_proxy import FaultProxy, MotoServer, key_matches, object_key

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


def test_ambiguous_window_lets_the_write_land_and_drops_its_answer(proxied) -> None:
    proxy, client = proxied  # the client retries once (botocore: max_attempts=1 is one retry)
    proxy.add_window("ambiguous", 30.0, keys="*/manifest.json", drops=1)
    client.put_object(Bucket="bkt", Key="run/step-1/zarr.json", Body=b"a")  # not matching: answered
    assert proxy.counts["ambiguous"] == 0
    # The conditional PUT lands, its answer is lost, the client's retry meets its own write: 412,
    # which is exactly what a commit must not take for "someone else committed".
    with pytest.raises(botocore.exceptions.ClientError) as err:
        client.put_object(Bucket="bkt", Key="run/step-1/manifest.json", Body=b"ours", IfNoneMatch="*")
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert proxy.counts["ambiguous"] == 1
    assert client.get_object(Bucket="bkt", Key="run/step-1/manifest.json")["Body"].read() == b"ours"
    client.put_object(Bucket="bkt", Key="run/step-1/manifest.json", Body=b"again")
    assert proxy.counts["ambiguous"] == 1, "drops = 1: the window dropped one answer, then none"


def test_ambiguous_window_drops_only_writes_to_matching_keys(proxied) -> None:
    proxy, client = proxied
    client.put_object(Bucket="bkt", Key="run/latest", Body=b"{}")
    proxy.add_window("ambiguous", 30.0, keys="latest")
    assert client.get_object(Bucket="bkt", Key="run/latest")["Body"].read() == b"{}", "reads are answered"
    client.put_object(Bucket="bkt", Key="run/latest.tmp", Body=b"x")
    assert proxy.counts["ambiguous"] == 0
    # drops = 0: every matching write while the window is open, the retry's too.
    with pytest.raises((botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        client.put_object(Bucket="bkt", Key="run/latest", Body=b'{"step": 4}')
    assert proxy.counts["ambiguous"] == 2
    assert client.get_object(Bucket="bkt", Key="run/latest")["Body"].read() == b'{"step": 4}'


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("*/manifest.json", "chaos-1/run/step-000000004/manifest.json", True),
        ("*/manifest.json", "chaos-1/run/step-000000004/manifest.json.tmp", False),
        ("latest", "run/latest", True),
        ("latest", "run/latest/x", False),
        ("run/latest", "chaos/run/latest", False),
        ("*", "anything/at/all", True),
    ],
)
def test_key_patterns(pattern: str, key: str, matches: bool) -> None:
    assert key_matches(pattern, key) is matches


def test_object_key_of_path_style_requests() -> None:
    assert object_key("/bkt/run/step-1/manifest.json?x-id=PutObject") == "run/step-1/manifest.json"
    assert object_key("/bkt/run/a%20b") == "run/a b"
    assert object_key("/bkt?delete") == "" and object_key("/bkt/") == ""
