"""The client end of the replication channel: sends to and fetches from one peer's ``ReplicationServer``.

No bounce buffers: a put's payload is sent from the caller's memory (e.g. the mapped snapshot slot),
encrypted chunk by chunk as it goes out, and ``get(key, into=...)`` has the reply decrypted straight
into the caller's memory (one buffer, or scattered over several: the training tensors). The wire
MAC covers every payload byte, so nothing here re-checksums.

The handshake must finish within ``timeout_s``; after it every read or write of a message must make
progress within ``timeout_s`` (a per-progress bound, so a throttled multi-GB copy is fine but a peer
that stalls mid-message is dropped). The secret is never logged, never put into an exception message
and never shown by ``repr``.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from resilient.errors import ConfigError
from resilient.recovery.channel.wire import (
    EMPTY,
    ChannelError,
    Destination,
    Message,
    Scatter,
    Session,
    byte_view,
    check_positive,
    check_secret,
    client_handshake,
    describe,
    encode_header,
)

log = logging.getLogger(__name__)

_MAX_KEY_CHARS = 4096


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > _MAX_KEY_CHARS:
        raise ConfigError(f"key must be a non-empty str of at most {_MAX_KEY_CHARS} chars, got {key!r:.80}")


class ReplicationClient:
    """Sends snapshots to, and fetches them back from, one buddy's ``ReplicationServer``.

    Connects lazily and keeps the connection for later requests; one request at a time (a lock).
    After any failure the connection is dropped (its stream position is unknown) and the next
    request reconnects.
    """

    def __init__(
        self,
        secret: bytes,
        address: tuple[str, int],
        *,
        rank: int,
        timeout_s: float = 30.0,
        bytes_per_s: float = 0.0,
    ) -> None:
        self._secret = check_secret(secret)
        check_positive("timeout_s", timeout_s)
        if bytes_per_s < 0:
            raise ConfigError(f"bytes_per_s must be >= 0 (0 = unthrottled), got {bytes_per_s}")
        self.address = (address[0], int(address[1]))
        self.rank = rank
        self.timeout_s = timeout_s
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._max_message_bytes = 0

    def __repr__(self) -> str:
        return f"ReplicationClient(rank={self.rank}, address={self.address}, connected={self._session is not None})"

    def __enter__(self) -> ReplicationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(self, key: str, header: dict, payload: bytes | bytearray | memoryview) -> None:
        """Store ``payload`` under ``key`` on the buddy; raises ChannelError if refused, failed or timed out."""
        _check_key(key)
        view = byte_view(payload, key)
        encode_header("put", key, header)  # fail on a bad header before touching the network
        with self._lock:
            self._request("put", key, header, view, expected=("ok",))

    def get(
        self, key: str, into: Callable[[dict, int], memoryview | Scatter | None] | None = None
    ) -> tuple[dict, bytearray | memoryview | Scatter] | None:
        """The buddy's copy of ``key`` (header, payload), or None when the buddy does not hold it.

        The payload is the memory it was received into, no copy of a possibly huge snapshot: fresh
        memory (``wire.fresh_buffer``: a bytearray, or from 8 MiB a memoryview over an anonymous
        mapping), or what ``into(header, nbytes)`` returned when given (called once the header is
        authenticated): one writable view, or a ``wire.Scatter`` of them filled in order; None there
        means fresh memory. Those views hold the sender's bytes only if ``get`` returns without
        raising.
        """
        _check_key(key)

        def destination(op: str, reply_key: str, meta: dict, nbytes: int) -> memoryview | Scatter | None:
            target = into(meta, nbytes) if into is not None and op == "value" else None
            if isinstance(target, Scatter):
                return Scatter([byte_view(view, key) for view in target.views], target.landed)
            return None if target is None else byte_view(target, key)

        with self._lock:
            reply = self._request("get", key, {}, EMPTY, expected=("value", "missing"), destination=destination)
        return None if reply.op == "missing" else (reply.meta, reply.payload)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _request(
        self,
        op: str,
        key: str,
        meta: dict,
        payload: memoryview,
        expected: tuple[str, ...],
        destination: Destination | None = None,
    ) -> Message:
        where = f"replication {op} of key {key!r} by rank {self.rank} to {self.address[0]}:{self.address[1]}"
        try:
            session = self._connect()
            if payload.nbytes > self._max_message_bytes:
                raise ChannelError(
                    f"payload of {payload.nbytes} bytes exceeds the server's max_message_bytes="
                    f"{self._max_message_bytes}; raise it on the buddy or send smaller pieces"
                )
            session.send(op, key, meta, payload, self.bytes_per_s)
            reply = session.receive(self._max_message_bytes, destination)
        except (ChannelError, OSError) as e:
            self._drop()
            raise ChannelError(f"{where} failed: {describe(e)}") from e
        except BaseException:  # e.g. from get's ``into``: the reply is half read, so the stream is lost
            self._drop()
            raise
        if reply.op == "error":
            raise ChannelError(f"{where} refused by the server: {reply.meta.get('message', 'no reason given')}")
        if reply.op not in expected or reply.key != key:
            self._drop()
            raise ChannelError(f"{where} got an unexpected reply {reply.op!r} for key {reply.key!r}")
        return reply

    def _connect(self) -> Session:
        if self._session is not None:
            return self._session
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as e:
            raise ChannelError(f"cannot connect: {describe(e)}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._session, self._max_message_bytes = client_handshake(sock, self._secret, self.rank, self.timeout_s)
        except BaseException:
            sock.close()
            raise
        log.debug("[rank %d] replication channel connected to %s:%d", self.rank, *self.address)
        return self._session

    def _drop(self) -> None:
        if self._session is not None:
            self._session.sock.close()
            self._session = None
