"""The replication channel over real loopback sockets: round trips, and every way a peer is refused.

Raw-socket attackers use the wire module's own framing helpers (``wire.client_handshake``, ``wire.Session.seal``)
so a test changes exactly one thing (a byte, a sequence number, a declared length) from a valid peer.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time

import pytest

from resilient.errors import ConfigError
from resilient.recovery.channel import ChannelError, ReplicationClient, ReplicationServer, wire
from tests.procs import wait_until

pytestmark = pytest.mark.timeout(60)


class MemoryHandler:
    """A buddy store in a dict; records who put what so tests can prove nothing was stored."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[dict, bytes]] = {}
        self.puts: list[tuple[int, str]] = []
        self.gets: list[tuple[int, str]] = []
        self.fail_puts = False

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        if self.fail_puts:
            raise RuntimeError("node memory budget exhausted")
        self.puts.append((sender_rank, key))
        self.items[key] = (header, bytes(payload))

    def get(self, requester_rank: int, key: str) -> tuple[dict, bytes] | None:
        self.gets.append((requester_rank, key))
        return self.items.get(key)


@pytest.fixture
def secret() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def handler() -> MemoryHandler:
    return MemoryHandler()


@pytest.fixture
def server(secret: bytes, handler: MemoryHandler):
    with ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as srv:
        yield srv


@pytest.fixture(autouse=True)
def secret_never_logged(caplog: pytest.LogCaptureFixture, secret: bytes):
    """Every test runs at DEBUG; afterwards no record (message, args or extras) may hold the secret."""
    caplog.set_level(logging.DEBUG)
    yield
    for record in caplog.records:
        text = record.getMessage() + repr(record.__dict__)
        assert not _contains_secret(text, secret), f"secret leaked into log record {record.msg!r}"


def _contains_secret(text: str, secret: bytes) -> bool:
    forms = (secret.hex(), secret.hex().upper(), repr(secret)[2:-1], secret.decode("latin-1"))
    return any(form in text for form in forms)


def _raw_session(server: ReplicationServer, secret: bytes, rank: int = 7) -> tuple[wire.Session, int]:
    sock = socket.create_connection(server.address, timeout=10.0)
    return wire.client_handshake(sock, secret, rank, timeout_s=10.0)


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed its end (EOF or reset); raises TimeoutError if it keeps it open."""
    try:
        while sock.recv(65536):
            pass  # whatever the server sent before closing (its greeting) is not the point here
    except ConnectionResetError:
        pass  # closing with our unread bytes in its buffer makes the kernel answer with a reset
    return True


def _assert_good_client_works(server: ReplicationServer, secret: bytes, handler: MemoryHandler) -> None:
    with ReplicationClient(secret, server.address, rank=1, timeout_s=10.0) as client:
        client.put("rank1/step-000000001", {"step": 1}, b"still serving")
        assert client.get("rank1/step-000000001") == ({"step": 1}, bytearray(b"still serving"))
    assert (1, "rank1/step-000000001") in handler.puts


@pytest.mark.parametrize("size", [3 * 1024 * 1024 + 17, 0])
def test_put_then_get_round_trips_header_and_payload(server, secret, handler, size):
    payload = secrets.token_bytes(size)
    header = {"step": 12, "dtype": "bfloat16", "shape": [size], "nested": {"ok": True}}
    with ReplicationClient(secret, server.address, rank=3) as client:
        client.put("rank3/step-000000012", header, payload)
        got = client.get("rank3/step-000000012")
    assert got is not None
    got_header, got_payload = got
    assert got_header == header
    assert bytes(got_payload) == payload
    assert handler.puts == [(3, "rank3/step-000000012")]
    assert handler.gets == [(3, "rank3/step-000000012")]
    assert server.stored == 1
    assert server.rejected == []


def test_one_connection_carries_many_requests_and_typed_buffers(server, secret, handler):
    # A float32 2-D view is sent as its raw bytes, not element by element.
    floats = memoryview(bytearray(range(64))).cast("f", shape=[4, 4])
    with ReplicationClient(secret, server.address, rank=2) as client:
        for step in range(5):
            client.put(f"rank2/step-{step:09d}", {"step": step}, floats)
        assert client.get("rank2/step-000000099") is None
        assert client.get("rank2/step-000000004") == ({"step": 4}, bytearray(range(64)))
    assert server.stored == 5
    assert [rank for rank, _ in handler.puts] == [2] * 5
    assert server.rejected == []


def test_wrong_secret_is_refused_and_nothing_stored(server, secret, handler, caplog):
    wrong = secrets.token_bytes(32)
    client = ReplicationClient(wrong, server.address, rank=4, timeout_s=10.0)
    with client, pytest.raises(ChannelError, match="secret differs") as info:
        client.put("rank4/step-000000001", {}, b"x" * 1000)
    assert "rank4/step-000000001" in str(info.value)
    assert handler.puts == []
    assert server.stored == 0
    wait_until(lambda: len(server.rejected) == 1)
    assert "proof of claimed rank 4 does not match the job secret" in server.rejected[0]
    assert any("refused" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for text in [str(info.value), *server.rejected]:
        assert not _contains_secret(text, secret) and not _contains_secret(text, wrong)


def test_client_sends_no_data_to_a_server_that_cannot_prove_the_secret(secret):
    """An impostor that answers the hello with a made-up proof receives nothing after the hello."""
    received = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10.0)

        def impostor() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(2.0)
                conn.sendall(wire.GREETING.pack(wire.MAGIC, secrets.token_bytes(32)))
                hello = conn.recv(wire.HELLO.size, socket.MSG_WAITALL)
                conn.sendall(wire.WELCOME.pack(1 << 30, secrets.token_bytes(32)))
                try:
                    while chunk := conn.recv(65536):
                        received.extend(chunk)
                except TimeoutError:
                    pass
                received[:0] = hello

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        client = ReplicationClient(secret, listener.getsockname()[:2], rank=5, timeout_s=10.0)
        with pytest.raises(ChannelError, match="failed to prove it knows the job secret"):
            client.put("rank5/step-000000001", {}, b"private snapshot bytes")
        client.close()
        thread.join(timeout=10.0)
    assert len(received) == wire.HELLO.size  # the hello, and not one byte of the snapshot
    assert b"private snapshot bytes" not in received


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64, secrets.token_bytes(200)],
    ids=["http", "random"],
)
def test_garbage_connection_is_refused_and_server_keeps_serving(server, secret, handler, garbage):
    with socket.create_connection(server.address, timeout=10.0) as raw:
        # Read the greeting first: a reset provoked by the garbage could discard it unread.
        assert raw.recv(wire.GREETING.size, socket.MSG_WAITALL)[:8] == wire.MAGIC
        raw.sendall(garbage)
        assert _closed_by_server(raw)
    wait_until(lambda: len(server.rejected) == 1)
    assert "handshake refused" in server.rejected[0]
    assert server.stored == 0 and handler.puts == []
    _assert_good_client_works(server, secret, handler)


def test_peer_that_stops_during_the_handshake_is_dropped_while_others_are_served(secret, handler):
    with ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=1.0) as server:
        with socket.create_connection(server.address, timeout=10.0) as raw:
            raw.sendall(b"\0" * 10)  # part of a hello, then silence
            _assert_good_client_works(server, secret, handler)
            assert _closed_by_server(raw)
        wait_until(lambda: len(server.rejected) == 1)
        assert "timed out waiting for the client hello" in server.rejected[0]
        assert handler.puts == [(1, "rank1/step-000000001")]
        assert server.stored == 1


@pytest.mark.parametrize("where", ["payload", "header", "mac", "prefix"])
def test_tampered_message_is_refused_and_nothing_stored(server, secret, handler, where):
    session, _ = _raw_session(server, secret)
    payload = bytearray(secrets.token_bytes(4096))
    head, body, mac = session.seal("put", "rank7/step-000000003", {"step": 3}, memoryview(payload))
    head, body, mac = bytearray(head), bytearray(body), bytearray(mac)
    # Flip one bit after the MAC was computed, as a man in the middle would.
    if where == "payload":
        body[1234] ^= 0x01
    elif where == "header":
        head[wire.PREFIX.size + 20] ^= 0x01  # the header is encrypted: any bit of it
    elif where == "mac":
        mac[0] ^= 0x01
    else:
        head[wire.PREFIX.size - 1] ^= 0x01  # payload_len 4096 -> 4097, then the MAC arrives one byte early
    session.sock.sendall(head + body + mac + (b"\0" if where == "prefix" else b""))
    with session.sock:
        assert _closed_by_server(session.sock)
    wait_until(lambda: len(server.rejected) == 1)
    assert "failed its MAC check" in server.rejected[0]
    assert "rank 7" in server.rejected[0]
    assert handler.puts == [] and server.stored == 0
    _assert_good_client_works(server, secret, handler)


def test_replayed_message_is_refused_on_the_same_and_a_new_connection(server, secret, handler):
    session, _ = _raw_session(server, secret)
    head, body, mac = session.seal("put", "rank7/step-000000005", {"step": 5}, memoryview(b"snapshot"))
    captured = head + body + mac
    session.sock.sendall(captured)
    assert session.receive(1 << 20).op == "ok"
    assert server.stored == 1

    session.sock.sendall(captured)  # same connection: the server now expects sequence number 1
    with session.sock:
        assert _closed_by_server(session.sock)
    wait_until(lambda: len(server.rejected) == 1)
    assert "message #1 failed its MAC check" in server.rejected[0]

    other, _ = _raw_session(server, secret)  # new connection: new nonces, so a new session key
    other.sock.sendall(captured)
    with other.sock:
        assert _closed_by_server(other.sock)
    wait_until(lambda: len(server.rejected) == 2)
    assert "message #0 failed its MAC check" in server.rejected[1]
    assert handler.puts == [(7, "rank7/step-000000005")]
    assert server.stored == 1


def test_declared_payload_over_max_is_refused_without_reading_it(secret, handler):
    with ReplicationServer(secret, handler, host="127.0.0.1", max_message_bytes=1024) as server:
        session, advertised = _raw_session(server, secret)
        assert advertised == 1024
        # Declare 1 TiB and send none of it: only a refusal before reading can answer this.
        session.sock.sendall(wire.PREFIX.pack(20, 1 << 40))
        reply = session.receive(1 << 20)
        assert reply.op == "error"
        assert "declared payload of 1099511627776 bytes exceeds max_message_bytes=1024" in reply.meta["message"]
        with session.sock:
            assert _closed_by_server(session.sock)
        wait_until(lambda: len(server.rejected) == 1)
        assert "refused before reading it" in server.rejected[0]
        assert handler.puts == [] and server.stored == 0


def test_client_refuses_a_payload_over_the_servers_max_before_sending(secret, handler):
    with ReplicationServer(secret, handler, host="127.0.0.1", max_message_bytes=1024) as server:
        with ReplicationClient(secret, server.address, rank=2) as client:
            with pytest.raises(ChannelError, match="exceeds the server's max_message_bytes=1024") as info:
                client.put("rank2/step-000000001", {}, b"x" * 1025)
            assert "rank2/step-000000001" in str(info.value)
            client.put("rank2/step-000000002", {}, b"x" * 1024)  # reconnects, and the limit is inclusive
        assert handler.puts == [(2, "rank2/step-000000002")]
        assert server.rejected == []


def test_handler_exception_becomes_an_error_naming_the_key_and_the_server_survives(server, secret, handler):
    handler.fail_puts = True
    with ReplicationClient(secret, server.address, rank=6) as client:
        with pytest.raises(ChannelError, match="refused by the server") as info:
            client.put("rank6/step-000000008", {}, b"abc")
        assert "'rank6/step-000000008'" in str(info.value)
        assert "node memory budget exhausted" in str(info.value)
        handler.fail_puts = False
        client.put("rank6/step-000000009", {}, b"abc")  # same connection, still in step
    assert handler.puts == [(6, "rank6/step-000000009")]
    assert server.rejected == []


def test_secret_appears_in_no_log_exception_or_repr(server, secret, handler, caplog):
    errors: list[str] = []
    with ReplicationClient(secrets.token_bytes(32), server.address, rank=9) as impostor:
        with pytest.raises(ChannelError) as info:
            impostor.put("rank9/step-000000001", {}, b"x")
        errors.append(str(info.value) + repr(info.value.__cause__))
    session, _ = _raw_session(server, secret)
    head, body, mac = session.seal("put", "rank7/step-000000001", {}, memoryview(b"abc"))
    session.sock.sendall(head + bytes([body[0], body[1], body[2] ^ 0x07]) + mac)
    with session.sock:
        assert _closed_by_server(session.sock)
    wait_until(lambda: len(server.rejected) == 2)
    with ReplicationClient(secret, server.address, rank=9) as client:
        errors.append(repr(client))
    errors += [repr(server), *server.rejected]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) >= 2  # the refusals were logged, so the check below has something to look at
    for text in errors + [r.getMessage() + repr(r.__dict__) for r in caplog.records]:
        assert not _contains_secret(text, secret)
    assert handler.puts == []


def test_bytes_per_s_throttles_sending(server, secret, handler):
    size, rate = 2 * 1024 * 1024, 8 * 1024 * 1024
    with ReplicationClient(secret, server.address, rank=1, bytes_per_s=rate) as client:
        client.put("rank1/step-000000000", {}, b"\0")  # connect first: time only the payload
        start = time.monotonic()
        client.put("rank1/step-000000001", {}, bytes(size))
        elapsed = time.monotonic() - start
    assert elapsed >= 0.9 * size / rate  # a lower bound only: a busy machine may be slower, never faster
    assert handler.items["rank1/step-000000001"][1] == bytes(size)


def test_stalled_peer_is_dropped_after_timeout_while_others_are_served(secret, handler):
    with ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=1.0) as server:
        session, _ = _raw_session(server, secret)
        head, _, _ = session.seal("put", "rank7/step-000000001", {}, memoryview(bytes(100_000)))
        session.sock.sendall(head + bytes(50_000))  # half the payload, then silence
        _assert_good_client_works(server, secret, handler)
        with session.sock:
            session.sock.settimeout(20.0)
            assert _closed_by_server(session.sock)
        wait_until(lambda: len(server.rejected) == 1)
        assert "timed out waiting for a payload" in server.rejected[0]
        assert handler.puts == [(1, "rank1/step-000000001")]
        assert server.stored == 1


def test_close_ends_idle_connections_and_refuses_new_ones(secret, handler):
    server = ReplicationServer(secret, handler, host="127.0.0.1")
    server.start()
    client = ReplicationClient(secret, server.address, rank=1, timeout_s=5.0)
    client.put("rank1/step-000000001", {}, b"a")  # leaves an idle, authenticated connection open
    server.close(timeout_s=5.0)
    assert [t for t in threading.enumerate() if t.name.startswith("resilient-channel")] == []
    with pytest.raises(ChannelError, match="rank1/step-000000002"):
        client.put("rank1/step-000000002", {}, b"b")
    client.close()
    assert server.rejected == []


def test_bad_configuration_is_rejected_with_the_field_named(handler):
    with pytest.raises(ConfigError, match="secret must be bytes of at least 16"):
        ReplicationServer(b"short", handler, host="127.0.0.1")
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        ReplicationClient(secrets.token_bytes(32), ("127.0.0.1", 1), rank=0, timeout_s=0)
    with pytest.raises(ConfigError, match="bytes_per_s must be >= 0"):
        ReplicationClient(secrets.token_bytes(32), ("127.0.0.1", 1), rank=0, bytes_per_s=-1)
    client = ReplicationClient(secrets.token_bytes(32), ("127.0.0.1", 1), rank=0)
    with pytest.raises(ConfigError, match="not JSON-serialisable"):
        client.put("rank0/step-000000001", {"bad": object()}, b"")
