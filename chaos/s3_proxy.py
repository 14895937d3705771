"""A loopback S3 endpoint (moto's server) and a fault-injecting HTTP proxy in front of it.

The job is pointed at the proxy (``AWS_ENDPOINT_URL``); the proxy forwards each HTTP/1.1 request to
moto unchanged (Host header included: SigV4 signs it) and, while a fault window is open:

- ``errors``: answers a fraction ``rate`` of requests with ``503 SlowDown`` (S3's throttling reply,
  which clients must retry with backoff) without forwarding them;
- ``resets``: closes a fraction ``rate`` of connections with a TCP RST instead of answering;
- ``latency``: delays every request by ``delay_s`` before forwarding it;
- ``ambiguous``: forwards a fraction ``rate`` of the requests that change the store (PUT, POST,
  DELETE) whose object key matches ``keys``, lets them take effect, then drops the response (TCP
  RST): the client cannot tell whether its write landed and retries it; at most ``drops`` of them
  per window (0: no limit). Keys are matched on path-style URLs (``/bucket/key``), which is what
  clients use against an IP endpoint; a pattern without ``/`` matches the key's last component.

Counts of what it did are kept per kind, for the report. Threads: one per client connection
(ThreadingHTTPServer), each with its own upstream connection; ``close()`` stops them all.
"""

from __future__ import annotations

import contextlib
import fnmatch
import http.client
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from resilient.dist import free_port

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate. (injected by resilient-chaos)</Message></Error>"
)
_MUTATING = {"PUT", "POST", "DELETE"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass(slots=True)
class Window:
    kind: str  # "errors" | "resets" | "latency" | "ambiguous"
    start: float
    end: float
    rate: float = 1.0
    delay_s: float = 0.0
    keys: str = "*"
    """ambiguous: glob of the object keys whose responses may be dropped."""
    drops: int = 0
    """ambiguous: most responses dropped in this window (0: no limit)."""
    dropped: int = 0


def key_matches(pattern: str, key: str) -> bool:
    """``pattern`` (a glob; ``*`` crosses ``/``) matches the whole key, or, without a ``/``, its last part."""
    if fnmatch.fnmatchcase(key, pattern):
        return True
    return "/" not in pattern and fnmatch.fnmatchcase(key.rsplit("/", 1)[-1], pattern)


def object_key(path: str) -> str:
    """The object key of a path-style request path (``/bucket/a/b?x=1`` -> ``a/b``; '' for the bucket)."""
    parts = urllib.parse.unquote(urllib.parse.urlsplit(path).path).lstrip("/").split("/", 1)
    return parts[1] if len(parts) > 1 else ""


@dataclass(slots=True)
class ProxyState:
    windows: list[Window] = field(default_factory=list)
    counts: dict[str, int] = field(
        default_factory=lambda: {"requests": 0, "errors": 0, "resets": 0, "delayed": 0, "ambiguous": 0}
    )
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def active(self, kind: str) -> Window | None:
        now = time.time()
        return next((w for w in self.windows if w.kind == kind and w.start <= now < w.end), None)

    def roll(self, rate: float) -> bool:
        with self.lock:
            return self.rng.random() < rate

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def claim_drop(self, method: str, key: str) -> bool:
        """True if an open ``ambiguous`` window takes this request's response (and counts it)."""
        if method not in _MUTATING:
            return False
        now = time.time()
        with self.lock:
            for w in self.windows:
                if w.kind != "ambiguous" or not w.start <= now < w.end or not key_matches(w.keys, key):
                    continue
                if (w.drops and w.dropped >= w.drops) or self.rng.random() >= w.rate:
                    continue
                w.dropped += 1
                self.counts["ambiguous"] += 1
                return True
        return False


class _ProxyHandler(BaseHTTPRequestHandler):
    """Forwards one client connection to the upstream endpoint, injecting what ``state`` has active."""

    upstream: tuple[str, int]
    state: ProxyState
    protocol_version = "HTTP/1.1"
    _conn: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        return

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length", "0") or 0)
        return self.rfile.read(length) if length else b""

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout: close() sends RST, as a dropped connection would.
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()

    def _forward(self) -> None:
        self.state.count("requests")
        body = self._body()
        if (w := self.state.active("resets")) is not None and self.state.roll(w.rate):
            self.state.count("resets")
            self._reset()
            return
        if (w := self.state.active("errors")) is not None and self.state.roll(w.rate):
            self.state.count("errors")
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOWDOWN_BODY)))
            self.end_headers()
            self.wfile.write(SLOWDOWN_BODY)
            return
        if (w := self.state.active("latency")) is not None:
            self.state.count("delayed")
            time.sleep(w.delay_s)
        drop = self.state.claim_drop(self.command, object_key(self.path))
        response, data = self._upstream(body)
        if drop:
            self._reset()  # the request took effect upstream; its answer never reaches the client
            return
        self._answer(response, data)

    def _upstream(self, body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
        for attempt in range(2):  # a kept-alive upstream connection moto closed: reconnect once
            if self._conn is None:
                self._conn = http.client.HTTPConnection(*self.upstream, timeout=120)
            try:
                self._conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for key, value in self.headers.items():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self._conn.putheader(key, value)
                self._conn.putheader("Content-Length", str(len(body)))
                self._conn.endheaders(body)
                response = self._conn.getresponse()
                return response, response.read()
            except (http.client.HTTPException, OSError):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable: the second try returns or raises")

    def _answer(self, response: http.client.HTTPResponse, data: bytes) -> None:
        self.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP_BY_HOP and not (key.lower() == "content-length" and self.command != "HEAD"):
                self.send_header(key, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815 (http.server's names)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        if self._conn is not None:
            self._conn.close()


def _handler(upstream: tuple[str, int], state: ProxyState) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_ProxyHandler,), {"upstream": upstream, "state": state})


class FaultProxy:
    """The fault-injecting proxy on 127.0.0.1 (``url``), forwarding to ``upstream_url``."""

    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:
        host, port = upstream_url.removeprefix("http://").rstrip("/").split(":")
        self.state = ProxyState(rng=random.Random(seed))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler((host, int(port)), self.state))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="chaos-s3-proxy", daemon=True)
        self._thread.start()

    def add_window(
        self, kind: str, seconds: float, *, rate: float = 1.0, delay_s: float = 0.0, keys: str = "*", drops: int = 0
    ) -> Window:
        now = time.time()
        window = Window(kind=kind, start=now, end=now + seconds, rate=rate, delay_s=delay_s, keys=keys, drops=drops)
        with self.state.lock:
            self.state.windows.append(window)
        return window

    @property
    def counts(self) -> dict[str, int]:
        with self.state.lock:
            return dict(self.state.counts)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


class MotoServer:
    """moto's S3 server on a free loopback port, in its own process (stopped by ``close()``)."""

    def __init__(self, log_path: str | None = None, start_timeout_s: float = 30.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        binary = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.proc: subprocess.Popen | None = None
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        try:
            self.proc = subprocess.Popen(
                [binary, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._wait_listening(start_timeout_s, log_path)
        except BaseException:
            self.close()  # neither the server (own session) nor its log file may outlive a failed start
            raise

    def _wait_listening(self, timeout_s: float, log_path: str | None) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {self.proc.returncode} before listening"
                    + (f" (see {log_path})" if log_path else "")
                )
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"moto_server did not listen on {self.url} within {timeout_s} s")

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=name)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
"""Credentials moto accepts, for the job and for the harness's own reads."""
