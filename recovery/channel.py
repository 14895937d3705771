"""Authenticated TCP channel that copies RAM-tier snapshots to a buddy rank on another node.

The copy never travels over the training process group: a slow or dead buddy must not stall a
collective, and nobody outside the job may plant or read a snapshot. Every peer and every message is
therefore authenticated with the job's secret (an HMAC key handed out through the rendezvous), and
anything that fails a check is dropped before a byte of it is stored.

Protocol, version 1 (integers big-endian, ``|`` is concatenation, ``sn``/``cn`` are 32-byte nonces)::

    S -> C  MAGIC(8) | sn
    C -> S  rank(i64) | cn | HMAC(secret, "resilient/channel/v1/client" | sn | cn | rank)
    S -> C  max_message_bytes(u64) | HMAC(secret, "resilient/channel/v1/server" | sn | cn | rank | max)
    then messages both ways:
            header_len(u32) | payload_len(u64) | header JSON {"op","key","meta"} | payload | MAC(32)
            MAC = HMAC(K, direction | seq(u64) | header_len | payload_len | header | payload)
            K   = HMAC(secret, "resilient/channel/v1/session" | sn | cn | rank)

- Both sides pick a fresh nonce, so neither proof can be replayed; distinct domain tags stop a proof
  being reflected back. A bad client proof makes the server close without answering; the client
  checks the server's proof before it sends any data, so it never hands a snapshot to an impostor.
- ``direction`` is ``c2s`` or ``s2c``; ``seq`` counts messages per direction from 0 and is NOT sent:
  the receiver uses the number it expects, so a replayed, dropped or reordered message fails its MAC,
  and the per-connection key K makes a message recorded on one connection worthless on another.
- The receiver refuses ``header_len`` > 1 MiB or ``payload_len`` > ``max_message_bytes`` before reading
  them, reads the whole payload into a buffer it owns, and parses or acts on nothing until the MAC
  verifies: ``handler.put`` only ever sees a complete, authenticated message.
- Ops: ``put`` -> ``ok`` | ``error``; ``get`` -> ``value`` (meta + payload) | ``missing`` | ``error``.
  A protocol violation closes the connection and its reason goes to ``ReplicationServer.rejected``; a
  handler exception becomes an ``error`` reply and the connection stays up.

Timeouts: the handshake must finish within ``timeout_s``; after it, every read or write of a message
must make progress within ``timeout_s`` (a per-progress bound, so a throttled multi-GB copy is fine but
a peer that stalls mid-message is dropped). An authenticated connection may sit idle between requests
(the buddy pushes one snapshot every few steps); ``close()`` ends it.

The secret is never logged, never put into an exception message and never shown by ``repr``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from resilient.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

_MAGIC = b"RSLCHAN1"
_NONCE_BYTES = 32
_MAC_BYTES = 32  # SHA-256
_MIN_SECRET_BYTES = 16  # an HMAC key shorter than this is guessable; token_bytes(32) is the norm
_GREETING = struct.Struct(f">8s{_NONCE_BYTES}s")
_HELLO = struct.Struct(f">q{_NONCE_BYTES}s{_MAC_BYTES}s")
_WELCOME = struct.Struct(f">Q{_MAC_BYTES}s")
_PREFIX = struct.Struct(">IQ")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")
_MAX_HEADER_BYTES = 1 << 20
_MAX_KEY_CHARS = 4096
_CHUNK_BYTES = 1 << 20  # sendall's timeout covers the whole call, so big payloads go out in chunks
_THROTTLE_SLICE_S = 0.1  # a throttled chunk is ~0.1 s of traffic, so the receiver never waits long
_MIN_THROTTLE_CHUNK = 4096
_POLL_S = 0.25  # how often idle waits look at the closing flag
_TAG_CLIENT = b"resilient/channel/v1/client"
_TAG_SERVER = b"resilient/channel/v1/server"
_TAG_SESSION = b"resilient/channel/v1/session"
_CLIENT_TO_SERVER = b"c2s"
_SERVER_TO_CLIENT = b"s2c"
_EMPTY = memoryview(b"")


class ChannelError(StorageError):
    """The replication channel refused, lost or timed out a connection or message (names peer and key)."""


class _PeerClosed(ChannelError):
    """The peer closed the connection; the handshake rephrases it (a refusal looks exactly like this)."""


class _OversizedMessage(ChannelError):
    """A declared length is over the limit; the server answers once and closes, the payload unread."""


class ChannelHandler(Protocol):
    """What the server stores into and serves from (the RAM tier's buddy store)."""

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        """Called only after the whole message arrived and its MAC verified; the buffer is the handler's."""
        ...

    def get(self, requester_rank: int, key: str) -> tuple[dict, bytes | memoryview] | None:
        """The held header and payload of ``key``, or None when it is not held here."""
        ...


@dataclass(frozen=True, slots=True)
class _Message:
    op: str
    key: str
    meta: dict
    payload: bytearray


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes | bytearray) or len(secret) < _MIN_SECRET_BYTES:
        raise ConfigError(
            f"secret must be bytes of at least {_MIN_SECRET_BYTES} (use secrets.token_bytes(32) from the rendezvous)"
        )
    return bytes(secret)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > _MAX_KEY_CHARS:
        raise ConfigError(f"key must be a non-empty str of at most {_MAX_KEY_CHARS} chars, got {key!r:.80}")


def _byte_view(data: bytes | bytearray | memoryview, key: str) -> memoryview:
    """A flat byte view of ``data`` without copying it (tensors' memoryviews may be typed or N-D)."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ConfigError(f"payload for key {key!r} is not C-contiguous; pass a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _proof(secret: bytes, tag: bytes, server_nonce: bytes, client_nonce: bytes, rank: int, extra: bytes = b"") -> bytes:
    return hmac.new(secret, tag + server_nonce + client_nonce + _I64.pack(rank) + extra, hashlib.sha256).digest()


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no progress within the timeout"
    return str(error) or type(error).__name__


def _recv_exactly(sock: socket.socket, view: memoryview, what: str, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; with ``deadline`` the whole read must finish by then (handshakes)."""
    received = 0
    while received < view.nbytes:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            count = sock.recv_into(view[received:], min(view.nbytes - received, _CHUNK_BYTES))
        except TimeoutError as e:
            raise ChannelError(f"timed out waiting for {what} ({received} of {view.nbytes} bytes arrived)") from e
        if count == 0:
            raise _PeerClosed(f"peer closed the connection during {what} ({received} of {view.nbytes} bytes arrived)")
        received += count


def _recv_struct(sock: socket.socket, layout: struct.Struct, what: str, deadline: float | None = None) -> tuple:
    buffer = bytearray(layout.size)
    _recv_exactly(sock, memoryview(buffer), what, deadline)
    return layout.unpack(buffer)


def _send_payload(sock: socket.socket, payload: memoryview, bytes_per_s: float) -> None:
    chunk = _CHUNK_BYTES
    if bytes_per_s > 0:
        chunk = int(min(_CHUNK_BYTES, max(_MIN_THROTTLE_CHUNK, bytes_per_s * _THROTTLE_SLICE_S)))
    start = time.monotonic()
    for offset in range(0, payload.nbytes, chunk):
        piece = payload[offset : offset + chunk]
        sock.sendall(piece)
        if bytes_per_s > 0:
            # Sleep until the bytes sent so far fit the budget, so the average rate never exceeds it
            # and the training job's own traffic keeps its share of the NIC.
            delay = start + (offset + piece.nbytes) / bytes_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def _encode_header(op: str, key: str, meta: dict) -> bytes:
    try:
        header = json.dumps({"op": op, "key": key, "meta": meta}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"header of key {key!r} is not JSON-serialisable: {e}") from e
    if len(header) > _MAX_HEADER_BYTES:
        raise ConfigError(f"header of key {key!r} is {len(header)} bytes; the limit is {_MAX_HEADER_BYTES}")
    return header


def _decode_header(header: bytearray) -> tuple[str, str, dict]:
    try:
        fields = json.loads(header)
        op, key, meta = fields["op"], fields["key"], fields["meta"]
    except (ValueError, TypeError, KeyError) as e:
        raise ChannelError(f"authenticated message has a malformed header: {_describe(e)}") from e
    if not (isinstance(op, str) and isinstance(key, str) and isinstance(meta, dict)):
        raise ChannelError("authenticated message has a malformed header: op/key/meta have wrong types")
    return op, key, meta


class _Session:
    """One authenticated connection: its key and the two implicit sequence numbers."""

    def __init__(self, sock: socket.socket, key: bytes, *, send_tag: bytes, recv_tag: bytes) -> None:
        self.sock = sock
        self._key = key
        self._send_tag, self._recv_tag = send_tag, recv_tag
        self._send_seq = self._recv_seq = 0

    def _mac(self, tag: bytes, seq: int) -> hmac.HMAC:
        return hmac.new(self._key, tag + _U64.pack(seq), hashlib.sha256)

    def seal(self, op: str, key: str, meta: dict, payload: memoryview = _EMPTY) -> tuple[bytes, bytes]:
        """Frame one message as (prefix + header, MAC); the payload itself goes out uncopied."""
        header = _encode_header(op, key, meta)
        head = _PREFIX.pack(len(header), payload.nbytes) + header
        mac = self._mac(self._send_tag, self._send_seq)
        mac.update(head)
        mac.update(payload)
        self._send_seq += 1
        return head, mac.digest()

    def send(self, op: str, key: str, meta: dict, payload: memoryview = _EMPTY, bytes_per_s: float = 0.0) -> None:
        head, mac = self.seal(op, key, meta, payload)
        self.sock.sendall(head)
        _send_payload(self.sock, payload, bytes_per_s)
        self.sock.sendall(mac)

    def receive(self, max_payload_bytes: int) -> _Message:
        prefix = bytearray(_PREFIX.size)
        _recv_exactly(self.sock, memoryview(prefix), "a message prefix")
        header_len, payload_len = _PREFIX.unpack(prefix)
        # Lengths are checked before reading: an oversized declaration must not make us allocate it.
        if header_len > _MAX_HEADER_BYTES:
            raise _OversizedMessage(f"declared header of {header_len} bytes exceeds the {_MAX_HEADER_BYTES} limit")
        if payload_len > max_payload_bytes:
            raise _OversizedMessage(
                f"declared payload of {payload_len} bytes exceeds max_message_bytes={max_payload_bytes}"
            )
        mac = self._mac(self._recv_tag, self._recv_seq)
        mac.update(prefix)
        header = bytearray(header_len)
        _recv_exactly(self.sock, memoryview(header), "a message header")
        mac.update(header)
        payload = bytearray(payload_len)
        self._recv_hashing(memoryview(payload), mac)
        received = bytearray(_MAC_BYTES)
        _recv_exactly(self.sock, memoryview(received), "a message MAC")
        if not hmac.compare_digest(mac.digest(), bytes(received)):
            raise ChannelError(f"message #{self._recv_seq} failed its MAC check (tampered, replayed or reordered)")
        self._recv_seq += 1
        op, key, meta = _decode_header(header)
        return _Message(op, key, meta, payload)

    def _recv_hashing(self, view: memoryview, mac: hmac.HMAC) -> None:
        # Hash each chunk as it lands, while it is still in cache, instead of a second pass at the end.
        for offset in range(0, view.nbytes, _CHUNK_BYTES):
            piece = view[offset : offset + _CHUNK_BYTES]
            _recv_exactly(self.sock, piece, f"a payload (its chunk at byte {offset} of {view.nbytes})")
            mac.update(piece)


def _client_handshake(sock: socket.socket, secret: bytes, rank: int, timeout_s: float) -> tuple[_Session, int]:
    """Prove the secret to the server and make it prove it back; returns the session and its size limit."""
    deadline = time.monotonic() + timeout_s
    magic, server_nonce = _recv_struct(sock, _GREETING, "the server greeting", deadline)
    if magic != _MAGIC:
        raise ChannelError("peer is not a replication channel server (unexpected greeting)")
    client_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(_HELLO.pack(rank, client_nonce, _proof(secret, _TAG_CLIENT, server_nonce, client_nonce, rank)))
    try:
        max_bytes, server_proof = _recv_struct(sock, _WELCOME, "the server's proof", deadline)
    except _PeerClosed as e:
        raise ChannelError(
            "server closed the connection after our proof: it refused us, so this process's job secret "
            "differs from the server's (check that both got it from the same rendezvous)"
        ) from e
    expected = _proof(secret, _TAG_SERVER, server_nonce, client_nonce, rank, _U64.pack(max_bytes))
    if not hmac.compare_digest(expected, server_proof):
        raise ChannelError("server failed to prove it knows the job secret; no data was sent to it")
    sock.settimeout(timeout_s)
    key = _proof(secret, _TAG_SESSION, server_nonce, client_nonce, rank)
    return _Session(sock, key, send_tag=_CLIENT_TO_SERVER, recv_tag=_SERVER_TO_CLIENT), max_bytes


def _server_handshake(
    sock: socket.socket, secret: bytes, max_message_bytes: int, timeout_s: float
) -> tuple[_Session, int]:
    """Check the client's proof (closing on failure, without answering) and prove the secret back."""
    deadline = time.monotonic() + timeout_s
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(_GREETING.pack(_MAGIC, server_nonce))
    rank, client_nonce, client_proof = _recv_struct(sock, _HELLO, "the client hello", deadline)
    if not hmac.compare_digest(_proof(secret, _TAG_CLIENT, server_nonce, client_nonce, rank), client_proof):
        raise ChannelError(f"handshake refused: proof of claimed rank {rank} does not match the job secret")
    limit = _U64.pack(max_message_bytes)
    sock.sendall(_WELCOME.pack(max_message_bytes, _proof(secret, _TAG_SERVER, server_nonce, client_nonce, rank, limit)))
    sock.settimeout(timeout_s)
    key = _proof(secret, _TAG_SESSION, server_nonce, client_nonce, rank)
    return _Session(sock, key, send_tag=_SERVER_TO_CLIENT, recv_tag=_CLIENT_TO_SERVER), rank


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the peer: nothing left to wake
        sock.shutdown(socket.SHUT_RDWR)


def lower_thread_priority(nice: int) -> None:
    """Run the calling thread at ``nice`` (Linux: per thread), so background copies take the CPU the
    training loop leaves instead of competing with it; a no-op where unsupported."""
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class ReplicationServer:
    """Accepts authenticated buddies and stores/serves their snapshots through ``handler``.

    One daemon thread accepts, one daemon thread serves each connection; ``rejected`` lists why
    connections or messages were refused (never containing the secret), ``stored`` counts puts handed
    to the handler.
    """

    def __init__(
        self,
        secret: bytes,
        handler: ChannelHandler,
        *,
        host: str,
        port: int = 0,
        timeout_s: float = 30.0,
        max_message_bytes: int = 1 << 34,
        thread_nice: int = 0,
    ) -> None:
        self._secret = _check_secret(secret)
        self._thread_nice = thread_nice
        _check_positive("timeout_s", timeout_s)
        if not 0 <= max_message_bytes < 1 << 64:
            raise ConfigError(f"max_message_bytes must be in [0, 2**64), got {max_message_bytes}")
        self._handler = handler
        self._bind = (host, port)
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.address: tuple[str, int] = (host, port)
        self.rejected: list[str] = []
        self.stored = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._connections: dict[threading.Thread, socket.socket] = {}
        self._errors: list[BaseException] = []

    def __repr__(self) -> str:
        return f"ReplicationServer(address={self.address}, stored={self.stored}, rejected={len(self.rejected)})"

    def __enter__(self) -> ReplicationServer:
        if self._listener is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._listener is not None:
            raise ChannelError(f"replication server on {self.address} is already started")
        try:
            self._listener = socket.create_server(self._bind)
        except OSError as e:
            raise ChannelError(f"replication server cannot listen on {self._bind[0]}:{self._bind[1]}: {e}") from e
        self._listener.settimeout(_POLL_S)  # accept() wakes up to notice close()
        self.address = self._listener.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="resilient-channel-accept", daemon=True)
        self._accept_thread.start()
        log.info("[channel %s:%d] replication server listening", *self.address, extra={"event": "channel_listen"})

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection, and wait up to ``timeout_s`` for their threads."""
        deadline = time.monotonic() + timeout_s
        self._closing.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=max(deadline - time.monotonic(), 0))
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            connections = list(self._connections.items())
        for _, sock in connections:
            _shutdown(sock)
        for thread, _ in connections:
            thread.join(timeout=max(deadline - time.monotonic(), 0))
        threads = [t for t, _ in connections] + ([self._accept_thread] if self._accept_thread else [])
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise ChannelError(
                f"replication server {self.address}: threads {alive} still running {timeout_s} s after close(); "
                "a handler call is probably stuck"
            )
        if self._errors:
            raise ChannelError(f"replication server {self.address} hit an internal error") from self._errors[0]

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                sock, peer_address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if not self._closing.is_set():
                    self._record_error(e)
                return
            peer = f"{peer_address[0]}:{peer_address[1]}"
            thread = threading.Thread(
                target=self._serve_connection, args=(sock, peer), name=f"resilient-channel-{peer}", daemon=True
            )
            with self._lock:
                self._connections[thread] = sock
            thread.start()

    def _serve_connection(self, sock: socket.socket, peer: str) -> None:
        lower_thread_priority(self._thread_nice)
        try:
            sock.settimeout(self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session, rank = _server_handshake(sock, self._secret, self.max_message_bytes, self.timeout_s)
            peer = f"{peer} (rank {rank})"
            log.debug("[channel %s:%d] %s connected", *self.address, peer)
            self._serve_requests(session, rank)
        except (ChannelError, OSError) as e:
            if not self._closing.is_set():
                self._refuse(peer, _describe(e))
        except Exception as e:  # a bug here must not vanish with the daemon thread: close() re-raises it
            self._record_error(e)
        finally:
            sock.close()
            with self._lock:
                self._connections.pop(threading.current_thread(), None)

    def _serve_requests(self, session: _Session, rank: int) -> None:
        while self._wait_for_request(session.sock):
            try:
                message = session.receive(self.max_message_bytes)
            except _OversizedMessage as e:
                # Answer once so the client learns why, then close: the unread payload desyncs the stream.
                session.send("error", "", {"message": f"{e}; refused before reading it"})
                raise ChannelError(f"{e}; refused before reading it") from e
            self._dispatch(session, rank, message)

    def _wait_for_request(self, sock: socket.socket) -> bool:
        """Wait, idle, for a request's first byte; False once the peer left or the server is closing."""
        sock.settimeout(_POLL_S)
        try:
            while not self._closing.is_set():
                try:
                    return bool(sock.recv(1, socket.MSG_PEEK))
                except TimeoutError:
                    continue
            return False
        finally:
            sock.settimeout(self.timeout_s)

    def _dispatch(self, session: _Session, rank: int, message: _Message) -> None:
        key = message.key
        if message.op == "put":
            reply = self._handle_put(rank, message)
        elif message.op == "get":
            reply = self._handle_get(rank, key)
        else:
            reply = ("error", {"message": f"unknown op {message.op!r}"}, _EMPTY)
        session.send(reply[0], key, reply[1], reply[2])

    def _handle_put(self, rank: int, message: _Message) -> tuple[str, dict, memoryview]:
        with self._lock:
            self.stored += 1
        try:
            self._handler.put(rank, message.key, message.meta, memoryview(message.payload))
        except Exception as e:
            return self._handler_failed("put", rank, message.key, e)
        return "ok", {}, _EMPTY

    def _handle_get(self, rank: int, key: str) -> tuple[str, dict, memoryview]:
        try:
            held = self._handler.get(rank, key)
            if held is None:
                return "missing", {}, _EMPTY
            meta, data = held
            _encode_header("value", key, meta)  # a bad header must become an error reply, not a half-sent one
            return "value", meta, _byte_view(data, key)
        except Exception as e:
            return self._handler_failed("get", rank, key, e)

    def _handler_failed(self, op: str, rank: int, key: str, error: Exception) -> tuple[str, dict, memoryview]:
        # Truncated: the reply header has a size limit and the full traceback is in this process's log.
        text = f"handler {op} of key {key!r} from rank {rank} failed: {type(error).__name__}: {error}"[:2000]
        log.warning(
            "[channel %s:%d] %s", *self.address, text, exc_info=error, extra={"event": "channel_handler_failed"}
        )
        return "error", {"message": text}, _EMPTY

    def _refuse(self, peer: str, reason: str) -> None:
        text = f"peer {peer}: {reason}"
        with self._lock:
            self.rejected.append(text)
        log.warning("[channel %s:%d] refused %s", *self.address, text, extra={"event": "channel_refused"})

    def _record_error(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)
        log.error("[channel %s:%d] internal error", *self.address, exc_info=error)


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
        self._secret = _check_secret(secret)
        _check_positive("timeout_s", timeout_s)
        if bytes_per_s < 0:
            raise ConfigError(f"bytes_per_s must be >= 0 (0 = unthrottled), got {bytes_per_s}")
        self.address = (address[0], int(address[1]))
        self.rank = rank
        self.timeout_s = timeout_s
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._session: _Session | None = None
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
        view = _byte_view(payload, key)
        _encode_header("put", key, header)  # fail on a bad header before touching the network
        with self._lock:
            self._request("put", key, header, view, expected=("ok",))

    def get(self, key: str) -> tuple[dict, bytearray] | None:
        """The buddy's copy of ``key`` (header, payload), or None when the buddy does not hold it.

        The payload is the bytearray it was received into: no copy of a possibly huge snapshot.
        """
        _check_key(key)
        with self._lock:
            reply = self._request("get", key, {}, _EMPTY, expected=("value", "missing"))
        return None if reply.op == "missing" else (reply.meta, reply.payload)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _request(self, op: str, key: str, meta: dict, payload: memoryview, expected: tuple[str, ...]) -> _Message:
        where = f"replication {op} of key {key!r} by rank {self.rank} to {self.address[0]}:{self.address[1]}"
        try:
            session = self._connect()
            if payload.nbytes > self._max_message_bytes:
                raise ChannelError(
                    f"payload of {payload.nbytes} bytes exceeds the server's max_message_bytes="
                    f"{self._max_message_bytes}; raise it on the buddy or send smaller pieces"
                )
            session.send(op, key, meta, payload, self.bytes_per_s)
            reply = session.receive(self._max_message_bytes)
        except (ChannelError, OSError) as e:
            self._drop()
            raise ChannelError(f"{where} failed: {_describe(e)}") from e
        if reply.op == "error":
            raise ChannelError(f"{where} refused by the server: {reply.meta.get('message', 'no reason given')}")
        if reply.op not in expected or reply.key != key:
            self._drop()
            raise ChannelError(f"{where} got an unexpected reply {reply.op!r} for key {reply.key!r}")
        return reply

    def _connect(self) -> _Session:
        if self._session is not None:
            return self._session
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as e:
            raise ChannelError(f"cannot connect: {_describe(e)}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._session, self._max_message_bytes = _client_handshake(sock, self._secret, self.rank, self.timeout_s)
        except BaseException:
            sock.close()
            raise
        log.debug("[rank %d] replication channel connected to %s:%d", self.rank, *self.address)
        return self._session

    def _drop(self) -> None:
        if self._session is not None:
            self._session.sock.close()
            self._session = None
