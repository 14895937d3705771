"""Puts received straight into a handler's memory (``reserve_put``) and gets into a caller's buffer.

The handler here is a one-slot store: it hands out its slot, and counts commits and aborts, so a test
can prove a tampered or refused put is never committed and a good one never touches ``put``.
"""

from __future__ import annotations

import secrets
import socket

import numpy as np
import pytest

from resilient.recovery.channel import ChannelError, ReplicationClient, ReplicationServer, wire
from resilient.recovery.channel.handler import PutTarget
from tests.procs import wait_until

pytestmark = pytest.mark.timeout(60)


class SlotHandler:
    def __init__(self, nbytes: int) -> None:
        self.slot = np.zeros(nbytes, dtype=np.uint8)
        self.committed: list[tuple[int, str, dict, int]] = []
        self.aborted: list[str] = []
        self.plain_puts = 0
        self.refuse: str | None = None
        self.short_buffer = False  # a reservation whose buffer does not fit the payload

    def reserve_put(self, sender_rank: int, key: str, header: dict, nbytes: int) -> PutTarget:
        if self.refuse:
            raise RuntimeError(self.refuse)

        def commit() -> None:
            self.committed.append((sender_rank, key, header, nbytes))

        size = nbytes - 1 if self.short_buffer else nbytes
        return PutTarget(memoryview(self.slot)[:size], commit, lambda: self.aborted.append(key))

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        self.plain_puts += 1

    def get(self, requester_rank: int, key: str) -> tuple[dict, memoryview] | None:
        if not self.committed or self.committed[-1][1] != key:
            return None
        nbytes = self.committed[-1][3]
        return {"nbytes": nbytes}, memoryview(self.slot)[:nbytes]


@pytest.fixture
def secret() -> bytes:
    return secrets.token_bytes(32)


def test_put_lands_in_the_handlers_slot_and_get_lands_in_the_callers_buffer(secret):
    nbytes = 24 * 1024 * 1024 + 7
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    handler = SlotHandler(nbytes)
    restored = np.zeros(nbytes, dtype=np.uint8)
    asked: list[tuple[dict, int]] = []

    def into(meta: dict, length: int) -> memoryview:
        asked.append((meta, length))
        return memoryview(restored)

    with (
        ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as server,
        ReplicationClient(secret, server.address, rank=3, timeout_s=10.0) as client,
    ):
        client.put("rank3/step-000000004", {"step": 4}, memoryview(data))
        got = client.get("rank3/step-000000004", into=into)
    assert handler.committed == [(3, "rank3/step-000000004", {"step": 4}, nbytes)]
    assert handler.aborted == [] and handler.plain_puts == 0
    assert np.array_equal(handler.slot, data)
    assert got is not None and got[0] == {"nbytes": nbytes}
    assert asked == [({"nbytes": nbytes}, nbytes)]
    assert np.array_equal(restored, data)
    assert np.shares_memory(np.asarray(got[1]), restored)
    assert server.stored == 1 and server.rejected == []


def test_tampered_put_is_aborted_never_committed(secret):
    handler = SlotHandler(4 * 1024 * 1024)
    payload = bytearray(secrets.token_bytes(4 * 1024 * 1024))
    with ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as server:
        sock = socket.create_connection(server.address, timeout=10.0)
        session, _ = wire.client_handshake(sock, secret, 5, timeout_s=10.0)
        head, body, tag = session.seal("put", "rank5/step-000000001", {}, memoryview(payload))
        body = bytearray(body)
        body[len(body) // 2] ^= 0x04  # a man in the middle, after the MAC
        with sock:
            sock.sendall(head + body + tag)
            wait_until(lambda: len(server.rejected) == 1)
        assert "failed its MAC check" in server.rejected[0]
    assert handler.aborted == ["rank5/step-000000001"]
    assert handler.committed == [] and server.stored == 0


def test_refused_reservation_is_an_error_reply_and_the_connection_stays_in_step(secret):
    handler = SlotHandler(2 * 1024 * 1024)
    handler.refuse = "no free slot for rank 2"
    with ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as server:
        with ReplicationClient(secret, server.address, rank=2, timeout_s=10.0) as client:
            with pytest.raises(ChannelError, match="no free slot for rank 2") as info:
                client.put("rank2/step-000000001", {}, bytes(2 * 1024 * 1024))
            assert "'rank2/step-000000001'" in str(info.value)
            handler.refuse = None
            client.put("rank2/step-000000002", {}, b"\x07" * 1000)  # same connection: the payload was drained
        assert server.rejected == []
        assert server.stored == 1
    assert handler.committed == [(2, "rank2/step-000000002", {}, 1000)]
    assert handler.aborted == [] and bytes(handler.slot[:1000]) == b"\x07" * 1000


def test_a_reservation_whose_buffer_does_not_fit_is_given_back(secret):
    # It was reserved, then refused: without abort() the handler's slot stayed leased forever.
    handler = SlotHandler(4096)
    handler.short_buffer = True
    with ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as server:
        with ReplicationClient(secret, server.address, rank=2, timeout_s=10.0) as client:
            with pytest.raises(ChannelError):
                client.put("rank2/step-000000001", {}, b"\x01" * 1000)
            handler.short_buffer = False
            client.put("rank2/step-000000002", {}, b"\x02" * 1000)  # the stream stayed in step
        assert server.stored == 1
    assert handler.aborted == ["rank2/step-000000001"]
    assert handler.committed == [(2, "rank2/step-000000002", {}, 1000)]


def test_get_whose_into_raises_drops_the_connection_and_the_next_get_works(secret):
    handler = SlotHandler(1000)
    with (
        ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as server,
        ReplicationClient(secret, server.address, rank=4, timeout_s=10.0) as client,
    ):
        client.put("rank4/step-000000001", {}, b"\x05" * 1000)

        def no_room(meta: dict, nbytes: int) -> memoryview:
            raise MemoryError(f"no room for {nbytes} bytes")

        with pytest.raises(MemoryError, match="no room for 1000 bytes"):
            client.get("rank4/step-000000001", into=no_room)
        assert "connected=False" in repr(client)  # the half-read reply is not left in the stream
        got = client.get("rank4/step-000000001")
    assert got is not None and bytes(got[1]) == b"\x05" * 1000
    assert got[0] == {"nbytes": 1000}


def test_get_into_a_scatter_lands_in_order_and_one_that_does_not_add_up_is_refused(secret):
    handler = SlotHandler(1000)
    first, second = bytearray(600), bytearray(400)
    seen: list[tuple[int, int]] = []
    with (
        ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as server,
        ReplicationClient(secret, server.address, rank=4, timeout_s=10.0) as client,
    ):
        client.put("rank4/step-000000001", {}, bytes(range(200)) * 5)
        scatter = wire.Scatter([memoryview(first), memoryview(second)], lambda i, piece: seen.append((i, piece.nbytes)))
        got = client.get("rank4/step-000000001", into=lambda meta, nbytes: scatter)
        assert got is not None and bytes(first) + bytes(second) == bytes(range(200)) * 5
        assert seen == [(0, 600), (1, 400)]
        short = wire.Scatter([memoryview(bytearray(999))])
        with pytest.raises(ChannelError, match="is not 1000 bytes long"):
            client.get("rank4/step-000000001", into=lambda meta, nbytes: short)
        assert client.get("rank4/step-000000001") is not None  # a new connection, in step
