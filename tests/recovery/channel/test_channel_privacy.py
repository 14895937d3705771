"""A stranger on the loopback who relays (and records) a buddy copy reads nothing of it: the
payload, the snapshot index in its header and the key are encrypted (before: authenticated only,
every byte of a group's state readable on the wire)."""

from __future__ import annotations

import secrets
import socket
import threading

import pytest

from resilient.recovery.channel import ReplicationClient, ReplicationServer

pytestmark = pytest.mark.timeout(60)


class _Keep:
    def __init__(self) -> None:
        self.items: dict[str, tuple[dict, bytes]] = {}

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        self.items[key] = (header, bytes(payload))

    def get(self, requester_rank: int, key: str) -> tuple[dict, bytes] | None:
        return self.items.get(key)


class _Eavesdropper:
    """A TCP relay on the loopback that records every byte it forwards, both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.seen = target, bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        inside, _ = self._listener.accept()
        outside = socket.create_connection(self.target)
        for src, dst in ((inside, outside), (outside, inside)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(1 << 16):
            with self._lock:
                self.seen += data
            dst.sendall(data)


def test_a_relaying_stranger_reads_nothing_of_a_buddy_copy():
    secret, handler = secrets.token_bytes(32), _Keep()
    payload = b"WEIGHTS-OF-GROUP-0:" * 50_000
    index = {"values": {"data.cursor": "CURSOR-1234567", "rng": "RNG-STATE-ABCDEF"}}
    with ReplicationServer(secret, handler, host="127.0.0.1", timeout_s=10.0) as server:
        relay = _Eavesdropper(server.address)
        with ReplicationClient(secret, relay.address, rank=3, timeout_s=10.0) as client:
            client.put("rank3/step-000000042", index, memoryview(payload))
            assert client.get("rank3/step-000000042") == (index, bytearray(payload))
    assert handler.items["rank3/step-000000042"] == (index, payload)
    seen = bytes(relay.seen)
    assert len(seen) > 2 * len(payload)  # it did relay the copy and its fetch
    for plain in (b"WEIGHTS-OF-GROUP-0", b"CURSOR-1234567", b"RNG-STATE-ABCDEF", b"step-000000042", b'"op"'):
        assert plain not in seen, plain
