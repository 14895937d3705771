"""The server end of the replication channel: accepts authenticated peers and stores into and
serves from a handler (``handler.ChannelHandler``: the RAM tier's buddy store, a heal source), and
the address it listens on (``bind_host``).

No bounce buffers: a handler with ``reserve_put`` has a put's payload decrypted straight into its
own memory (e.g. a buddy store slot), chunk by chunk as it lands. The wire MAC covers every payload
byte, so nothing here re-checksums.

A protocol violation closes the connection and its reason goes to
``ReplicationServer.rejected``; a handler exception becomes an ``error`` reply and the connection
stays up.

Timeouts: the handshake must finish within ``HANDSHAKE_S`` (or ``timeout_s`` if shorter), and at
most ``MAX_UNAUTHENTICATED`` connections may be in it at once (more are closed at once); a failed
accept (no descriptor left) is retried, never the end of the server; after it, every read or write of a message
must make progress within ``timeout_s`` (a per-progress bound, so a throttled multi-GB copy is fine but
a peer that stalls mid-message is dropped). An authenticated connection may sit idle between requests
(the buddy pushes one snapshot every few steps); ``close()`` ends it.

The secret is never logged, never put into an exception message and never shown by ``repr``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

from resilient.errors import ConfigError
from resilient.recovery.channel.handler import ChannelHandler, PutTarget
from resilient.recovery.channel.wire import (
    DISCARD,
    EMPTY,
    ChannelError,
    Message,
    OversizedMessage,
    Scatter,
    Session,
    byte_view,
    check_positive,
    check_secret,
    describe,
    encode_header,
    server_handshake,
)
from resilient.recovery.config import RamTierConfig

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often idle waits look at the closing flag
MAX_UNAUTHENTICATED = 16
"""Connections that have not finished the handshake, at most: more are closed at once, so that
idle strangers cannot take every file descriptor (nor thread) of the process."""
HANDSHAKE_S = 5.0
"""The handshake's deadline (a peer of the job answers in milliseconds), shorter than ``timeout_s``."""
_ACCEPT_BACKOFF_S = (0.01, 1.0)


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
        self._secret = check_secret(secret)
        self._thread_nice = thread_nice
        check_positive("timeout_s", timeout_s)
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
        self._unauthenticated = 0
        self.handshake_s = min(HANDSHAKE_S, timeout_s)
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
        """Accept until ``close``. An accept that fails (no file descriptor left, a connection reset
        before it was taken) is transient: wait a little, longer each time, and go on, so that the
        buddy copies and heals of this process never stop for good."""
        assert self._listener is not None
        backoff = _ACCEPT_BACKOFF_S[0]
        while not self._closing.is_set():
            try:
                sock, peer_address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closing.is_set():
                    return
                log.warning("[channel %s:%d] accept failed (%s): retrying in %.2f s", *self.address, e, backoff)
                self._closing.wait(backoff)
                backoff = min(backoff * 2, _ACCEPT_BACKOFF_S[1])
                continue
            backoff = _ACCEPT_BACKOFF_S[0]
            peer = f"{peer_address[0]}:{peer_address[1]}"
            with self._lock:
                crowded = self._unauthenticated >= MAX_UNAUTHENTICATED
                if not crowded:
                    self._unauthenticated += 1
            if crowded:
                sock.close()
                self._refuse(peer, f"{MAX_UNAUTHENTICATED} connections are already in their handshake: closed")
                continue
            thread = threading.Thread(
                target=self._serve_connection, args=(sock, peer), name=f"resilient-channel-{peer}", daemon=True
            )
            with self._lock:
                self._connections[thread] = sock
            thread.start()

    def _serve_connection(self, sock: socket.socket, peer: str) -> None:
        lower_thread_priority(self._thread_nice)
        pending = [True]  # counted among the unauthenticated until the handshake ends
        try:
            sock.settimeout(self.handshake_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session, rank = server_handshake(sock, self._secret, self.max_message_bytes, self.handshake_s)
            self._authenticated(pending)
            sock.settimeout(self.timeout_s)
            peer = f"{peer} (rank {rank})"
            log.debug("[channel %s:%d] %s connected", *self.address, peer)
            self._serve_requests(session, rank)
        except (ChannelError, OSError) as e:
            if not self._closing.is_set():
                self._refuse(peer, describe(e))
        except Exception as e:  # a bug here must not vanish with the daemon thread: close() re-raises it
            self._record_error(e)
        finally:
            self._authenticated(pending)
            sock.close()
            with self._lock:
                self._connections.pop(threading.current_thread(), None)

    def _authenticated(self, pending: list[bool]) -> None:
        """The connection left its handshake (done or failed): one fewer unauthenticated."""
        if pending[0]:
            pending[0] = False
            with self._lock:
                self._unauthenticated -= 1

    def _serve_requests(self, session: Session, rank: int) -> None:
        while self._wait_for_request(session.sock):
            landing = _Landing(self._handler, rank)
            try:
                message = session.receive(self.max_message_bytes, landing.destination)
            except OversizedMessage as e:
                # Answer once so the client learns why, then close: the unread payload desyncs the stream.
                session.send("error", "", {"message": f"{e}; refused before reading it"})
                raise ChannelError(f"{e}; refused before reading it") from e
            except BaseException:
                landing.abort()
                raise
            self._dispatch(session, rank, message, landing)

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

    def _dispatch(self, session: Session, rank: int, message: Message, landing: _Landing) -> None:
        key = message.key
        if message.op == "put":
            reply = self._handle_put(rank, message, landing)
        elif message.op == "get":
            reply = self._handle_get(rank, key)
        else:
            reply = ("error", {"message": f"unknown op {message.op!r}"}, EMPTY)
        session.send(reply[0], key, reply[1], reply[2])

    def _handle_put(self, rank: int, message: Message, landing: _Landing) -> tuple[str, dict, memoryview]:
        if landing.refused is not None:
            return self._handler_failed("put", rank, message.key, landing.refused)
        with self._lock:
            self.stored += 1
        try:
            if landing.target is not None:
                landing.target.commit()
            else:
                self._handler.put(rank, message.key, message.meta, memoryview(message.payload))
        except Exception as e:
            return self._handler_failed("put", rank, message.key, e)
        return "ok", {}, EMPTY

    def _handle_get(self, rank: int, key: str) -> tuple[str, dict, memoryview]:
        try:
            held = self._handler.get(rank, key)
            if held is None:
                return "missing", {}, EMPTY
            meta, data = held
            encode_header("value", key, meta)  # a bad header must become an error reply, not a half-sent one
            return "value", meta, byte_view(data, key)
        except Exception as e:
            return self._handler_failed("get", rank, key, e)

    def _handler_failed(self, op: str, rank: int, key: str, error: Exception) -> tuple[str, dict, memoryview]:
        # Truncated: the reply header has a size limit and the full traceback is in this process's log.
        text = f"handler {op} of key {key!r} from rank {rank} failed: {type(error).__name__}: {error}"[:2000]
        log.warning(
            "[channel %s:%d] %s", *self.address, text, exc_info=error, extra={"event": "channel_handler_failed"}
        )
        return "error", {"message": text}, EMPTY

    def _refuse(self, peer: str, reason: str) -> None:
        text = f"peer {peer}: {reason}"
        with self._lock:
            self.rejected.append(text)
        log.warning("[channel %s:%d] refused %s", *self.address, text, extra={"event": "channel_refused"})

    def _record_error(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)
        log.error("[channel %s:%d] internal error", *self.address, exc_info=error)


class _Landing:
    """Where one incoming message's payload goes: the handler's ``reserve_put`` target for a put
    (when it has one), else a fresh buffer; a refused reservation reads and drops the payload."""

    def __init__(self, handler: ChannelHandler, rank: int) -> None:
        self._handler, self._rank = handler, rank
        self.target: PutTarget | None = None
        self.refused: Exception | None = None

    def destination(self, op: str, key: str, meta: dict, nbytes: int) -> memoryview | Scatter | None:
        reserve = getattr(self._handler, "reserve_put", None)
        if op != "put" or reserve is None:
            return None
        try:
            target = reserve(self._rank, key, meta, nbytes)
        except Exception as e:  # the reply names it; the stream stays in step by reading the payload
            self.refused = e
            return DISCARD
        try:
            buffer = byte_view(target.buffer, key)
        except Exception as e:  # a reservation made but unusable: give it back, then refuse as above
            target.abort()
            self.refused = e
            return DISCARD
        self.target = target
        if target.landed is not None:
            landed = target.landed
            return Scatter([buffer], lambda _, piece: landed(piece))
        return buffer

    def abort(self) -> None:
        if self.target is not None:
            self.target.abort()


def bind_host(config: RamTierConfig) -> str:
    """``recovery.bind_host``, else the local address of the interface that reaches the job's master."""
    if config.bind_host:
        return config.bind_host
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    # The job's own network: connecting a UDP socket sends nothing, and gethostname() can resolve
    # to 127.0.1.1.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(master), port))
        return probe.getsockname()[0]
