"""The channel server keeps accepting through transient accept errors and bounds strangers that
never finish the handshake (before: one EMFILE ended its accept loop for the process's life, and
80 idle connections under a 64-fd limit stopped every buddy copy and heal)."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.recovery.channel import ChannelError, ReplicationClient, ReplicationServer
from resilient.recovery.channel import server as channel

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(90)
def test_idle_strangers_past_the_fd_limit_do_not_stop_the_server():
    secret = secrets.token_bytes(32)
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.recovery.channel.fd_server", secret.hex(), "6"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    idle: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        time.sleep(0.5)  # the server has run out of descriptors accepting them
        with ReplicationClient(secret, ("127.0.0.1", port), rank=0, timeout_s=30) as client:
            assert client.get("key") == ({}, bytearray(b"value"))
    finally:
        for sock in idle:
            sock.close()
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.mark.timeout(60)
def test_connections_past_the_unauthenticated_bound_are_closed_at_once(monkeypatch):
    monkeypatch.setattr(channel, "MAX_UNAUTHENTICATED", 3)
    secret = secrets.token_bytes(32)

    class Nothing:
        def put(self, *args: object) -> None: ...

        def get(self, *args: object) -> None:
            return None

    with ReplicationServer(secret, Nothing(), host="127.0.0.1", timeout_s=10.0) as server:
        idle = [socket.create_connection(server.address, timeout=5) for _ in range(3)]
        time.sleep(0.3)
        extra = socket.create_connection(server.address, timeout=5)
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed without a greeting
        deadline = time.monotonic() + 5
        while not any("already in their handshake" in r for r in server.rejected) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(
            f"{channel.MAX_UNAUTHENTICATED} connections are already in their handshake" in r for r in server.rejected
        )
        for sock in (*idle, extra):
            sock.close()
        stranger = ReplicationClient(secret[::-1], server.address, rank=0, timeout_s=5)
        with pytest.raises(ChannelError), stranger:  # still a real refusal for a wrong secret, not a hang
            stranger.get("k")
        # The bound frees as each handshake thread sees its peer gone (later on a loaded machine).
        deadline = time.monotonic() + 20
        while server._unauthenticated and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server._unauthenticated == 0, "the closed connections still hold the handshake bound"
        with ReplicationClient(secret, server.address, rank=0, timeout_s=10) as client:
            assert client.get("k") is None  # the bound freed once they left
