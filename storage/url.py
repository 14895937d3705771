"""Checkpoint root URLs: a local path or ``file://``, ``s3://bucket/prefix``, ``memory://name``.

URLs stay strings end to end (a ``pathlib.Path`` would collapse ``s3://`` into ``s3:/``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlparse

from resilient.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Location:
    """A parsed checkpoint root. ``prefix`` never starts or ends with '/'."""

    scheme: str  # "file" | "s3" | "memory"
    bucket: str  # s3 bucket, memory store name, or "" for files
    prefix: str  # directory (file) or key prefix (s3, memory)
    endpoint: str | None = None
    region: str = "us-east-1"
    options: dict = field(default_factory=dict, compare=False)

    @property
    def url(self) -> str:
        if self.scheme == "file":
            return "/" + self.prefix
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def join(self, *parts: str) -> str:
        """The key of ``parts`` under this root, relative to the bucket (or filesystem root)."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))

    def child(self, *parts: str) -> Location:
        return Location(self.scheme, self.bucket, self.join(*parts), self.endpoint, self.region, self.options)


_SCHEMES = ("file", "s3", "memory")
_SCHEME_PREFIX = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")


def _refuse_scheme_typo(url: str) -> None:
    """A URL missing a slash (``s3:/bucket/x``, ``file:/x``) would otherwise be a local directory
    named ``s3:`` in the cwd: a run that "saves to S3" while writing next to the code."""
    head = _SCHEME_PREFIX.match(url)
    if head and (head.group(1).lower() in _SCHEMES or url[head.end() :].startswith("/")):
        known = head.group(1).lower() in _SCHEMES
        write = f"write {head.group(1)}://... " if known else ""
        raise ConfigError(
            f"{url!r} looks like a URL without '://': {write}(supported: s3://bucket/prefix, file:///abs/path, "
            "memory://name or a local path, which must not start with 'scheme:')"
        )


def parse_url(url: str, storage_options: dict | None = None) -> Location:
    """Parse a checkpoint root. S3 endpoint and region come from ``storage_options``
    (``endpoint_url``, ``region``) or the standard ``AWS_ENDPOINT_URL[_S3]`` / ``AWS_REGION`` env."""
    opts = dict(storage_options or {})
    if not isinstance(url, str) or not url:
        raise ConfigError(f"checkpoint URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        _refuse_scheme_typo(url)
        return Location("file", "", os.path.abspath(url).strip("/"), options=opts)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL {url!r} names host {parsed.netloc!r}; use file:///abs/path")
        return Location("file", "", os.path.abspath(parsed.path).strip("/"), options=opts)
    if parsed.scheme == "s3":
        if len(parsed.netloc) < 3:
            raise ConfigError(f"S3 URL {url!r} has no valid bucket name; expected s3://bucket/prefix")
        endpoint = (
            opts.pop("endpoint_url", None)
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        region = (
            opts.pop("region", None)
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
        )
        return Location("s3", parsed.netloc, parsed.path.strip("/"), endpoint, region, opts)
    if parsed.scheme == "memory":
        return Location("memory", parsed.netloc or "default", parsed.path.strip("/"), options=opts)
    raise ConfigError(
        f"unsupported checkpoint URL {url!r}: use a local path, file:///path, s3://bucket/prefix or memory://name"
    )
