"""S3 (or any S3-compatible store) through boto3: small objects, listings, deletes, commit markers.

The commit point is a conditional PUT (``If-None-Match: *``): of two writers of the same manifest
exactly one succeeds, with no lock service. A PUT whose response is lost is ambiguous: botocore
retries it, and the retry meets our own object (412). So a 412 is answered by reading the object
back: it is ours iff it holds exactly our bytes (a manifest names its attempt's uuid).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from resilient.errors import StorageError
from resilient.manifest import MANIFEST
from resilient.storage.url import Location

_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_EXISTS_CODES = {"PreconditionFailed", "412"}
# 409: another conditional write to the same key was in flight; S3 says to retry, nothing exists yet.
_CONFLICT_CODES = {"ConditionalRequestConflict", "409"}
CONFLICT_BACKOFF_S = 0.1
"""First wait before a conditional PUT is tried again (doubling, up to COMMIT_BACKOFF_CAP_S)."""


# The commit point must be decided within the grace the other ranks give the coordinator after
# the deadline (commit.decision_grace_s): otherwise rank 0 could commit a step that its peers
# already reported "not committed" (botocore's defaults above bound a PUT only by 8 x 130 s). So
# the manifest's conditional PUT, and the read that resolves a 412, go through a client that makes
# one try of at most COMMIT_CALL_S, and write_if_absent retries on its own clock (409, 5xx,
# throttling, timeouts), starting no try after COMMIT_RETRY_WINDOW_S.
_COMMIT_CONNECT_S, _COMMIT_READ_S = 3, 7
COMMIT_CALL_S = _COMMIT_CONNECT_S + _COMMIT_READ_S
COMMIT_RETRY_WINDOW_S = 20.0
COMMIT_BACKOFF_CAP_S = 2.0
COMMIT_WRITE_BOUND_S = COMMIT_RETRY_WINDOW_S + COMMIT_BACKOFF_CAP_S + 2 * COMMIT_CALL_S
"""The longest ``write_if_absent`` lasts: a last PUT started at the window's end, then the read
after a 412."""
_FATAL_CODES = {"AccessDenied", "NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "404"}
"""Answers a retry cannot change: raised at once."""


def s3_client(location: Location, *, bounded_for_commit: bool = False):
    import boto3
    from botocore.config import Config

    if bounded_for_commit:
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # write_if_absent retries
            connect_timeout=_COMMIT_CONNECT_S,
            read_timeout=_COMMIT_READ_S,
        )
    else:
        config = Config(
            retries={"max_attempts": 8, "mode": "standard"},
            connect_timeout=10,
            read_timeout=120,
            max_pool_connections=64,
        )
    return boto3.client("s3", endpoint_url=location.endpoint, region_name=location.region, config=config)


def _code(err: Exception | None) -> str:
    response = getattr(err, "response", None) or {}  # connection errors carry none (or None)
    return str(response.get("Error", {}).get("Code", ""))


class S3ObjectStore:
    def __init__(self, location: Location) -> None:
        self.location = location
        self.bucket = location.bucket
        self._client = s3_client(location)
        self._commit_client = s3_client(location, bounded_for_commit=True)  # write_if_absent only

    def _key(self, key: str) -> str:
        return self.location.join(key)

    def _fail(self, op: str, key: str, err: Exception) -> StorageError:
        where = f"s3://{self.bucket}/{self._key(key)}"
        endpoint = f" at endpoint {self.location.endpoint}" if self.location.endpoint else ""
        return StorageError(f"{op} {where}{endpoint} failed: {err}; check the bucket, credentials and endpoint")

    def read(self, key: str) -> bytes | None:
        return self._read_with(self._client, key)

    def _read_with(self, client, key: str) -> bytes | None:
        try:
            return client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except Exception as e:
            if _code(e) in _MISSING_CODES:
                return None
            raise self._fail("reading", key, e) from e

    def write(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as e:
            raise self._fail("writing", key, e) from e

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """True iff ``key`` now holds ``data`` from this call (or from an earlier try of it whose
        response was lost); False if another writer's bytes are there. Lasts at most
        ``COMMIT_WRITE_BOUND_S`` (see above); 409s, 5xx, throttling and timeouts are retried."""
        delay, start, tries = CONFLICT_BACKOFF_S, time.monotonic(), 0
        last: Exception | None = None
        while tries == 0 or time.monotonic() - start <= COMMIT_RETRY_WINDOW_S:
            if tries:
                time.sleep(delay)
                delay = min(2 * delay, COMMIT_BACKOFF_CAP_S)
            tries += 1
            try:
                self._commit_client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
                return True
            except Exception as e:
                last = e
                code = _code(e)
                if code in _FATAL_CODES:
                    raise self._fail("creating", key, e) from e
                if code in _EXISTS_CODES:
                    try:
                        stored = self._read_with(self._commit_client, key)
                    except StorageError as read_error:
                        last = read_error  # the read-back failed: try the PUT again (412 again, read again)
                        continue
                    if stored is not None:
                        return stored == data
                    # Deleted between the 412 and our read: nothing is there, so try again.
        where = f"s3://{self.bucket}/{self._key(key)}"
        why = (
            "409 ConditionalRequestConflict: another writer is saving the same step; stop it"
            if (_code(last) in _CONFLICT_CODES)
            else f"{last}; check the endpoint"
        )
        raise StorageError(
            f"creating {where} failed after {tries} tries in {time.monotonic() - start:.0f} s ({why}), then save again"
        )

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            if _code(e) in _MISSING_CODES:
                return False
            raise self._fail("checking", key, e) from e

    def _pages(self, key: str, delimiter: str | None):
        prefix = self._key(key)
        prefix = prefix + "/" if prefix else ""
        kwargs = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(**kwargs):
                yield prefix, page
        except Exception as e:
            raise self._fail("listing", key, e) from e

    def list_children(self, key: str) -> list[str]:
        names = set()
        for prefix, page in self._pages(key, "/"):
            names.update(p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", []))
            names.update(o["Key"][len(prefix) :] for o in page.get("Contents", []))
        return sorted(names)

    def list_keys(self, key: str) -> list[str]:
        out = []
        for prefix, page in self._pages(key, None):
            out.extend(o["Key"][len(prefix) :] for o in page.get("Contents", []))
        return sorted(out)

    def delete_prefix(self, key: str) -> None:
        """Delete ``key`` and everything under it. Commit markers (manifests) go first, in a batch of
        their own: if one cannot be deleted, nothing it names is touched (a step whose data is gone
        must not stay committed). Per-key failures inside a 200 answer raise too."""
        keys = [self.location.join(key, k) for k in self.list_keys(key)]
        if self.exists(key):
            keys.append(self._key(key))
        markers = [k for k in keys if k.rsplit("/", 1)[-1] == MANIFEST]
        rest = [k for k in keys if k.rsplit("/", 1)[-1] != MANIFEST]
        try:
            for i in range(0, len(markers), 1000):
                self._delete_batch(key, markers[i : i + 1000])
            batches = [rest[i : i + 1000] for i in range(0, len(rest), 1000)]
            with ThreadPoolExecutor(max_workers=8, thread_name_prefix="resilient-s3-delete") as pool:
                list(pool.map(lambda batch: self._delete_batch(key, batch), batches))
        except StorageError:
            raise
        except Exception as e:
            raise self._fail("deleting", key, e) from e

    def _delete_batch(self, prefix: str, batch: list[str]) -> None:
        objects = [{"Key": k} for k in batch]
        response = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
        # DeleteObjects answers 200 even when keys failed; the failures are listed in Errors.
        errors = response.get("Errors") or []
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more key(s))" if len(errors) > 1 else ""
            raise StorageError(
                f"deleting s3://{self.bucket}/{first.get('Key')} under {self.location.url}/{prefix} failed: "
                f"{first.get('Code')}: {first.get('Message')}{more}; what failed is still there: "
                "check delete permissions on the bucket; retention tries again after the next commit "
                f"(or run resilient-ckpt prune {self.location.url} --keep-last N)"
            )

    def check_root(self, *, create: bool) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            endpoint = self.location.endpoint or "the default AWS endpoint"
            if _code(e) in _MISSING_CODES | {"NoSuchBucket"}:
                raise StorageError(
                    f"bucket {self.bucket!r} does not exist at {endpoint} (URL {self.location.url}); "
                    "create it or fix the URL"
                ) from e
            raise StorageError(
                f"cannot reach bucket {self.bucket!r} at {endpoint} (URL {self.location.url}): {e}; "
                "check the endpoint (AWS_ENDPOINT_URL) and credentials"
            ) from e
