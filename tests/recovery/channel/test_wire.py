"""The wire format on its own, over a socketpair: GMAC framing, sequence numbers, destinations.

One ``Session`` per end, keyed as the handshake would key them; a sender thread lets frames larger
than the socket buffers flow while the receiver reads.
"""

from __future__ import annotations

import mmap
import pathlib
import secrets
import socket
import threading

import numpy as np
import pytest
import torch

from resilient.recovery.channel import wire

pytestmark = pytest.mark.timeout(60)

C2S, S2C = b"c2s\0", b"s2c\0"


@pytest.fixture
def pair():
    """(client, server) sessions sharing one key, as after a handshake."""
    key = secrets.token_bytes(32)
    a, b = socket.socketpair()
    a.settimeout(20.0)
    b.settimeout(20.0)
    client = wire.Session(a, key, send_tag=C2S, recv_tag=S2C)
    server = wire.Session(b, key, send_tag=S2C, recv_tag=C2S)
    yield client, server
    a.close()
    b.close()


def _in_background(fn) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised by the test through .errors
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def _random(nbytes: int) -> np.ndarray:
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("into_destination", [False, True], ids=["own_buffer", "destination"])
def test_large_frame_round_trips_bit_exact(pair, into_destination):
    client, server = pair
    nbytes = 48 * 1024 * 1024 + 13  # several chunks and a ragged tail
    data = _random(nbytes)
    landing = np.zeros(nbytes, dtype=np.uint8)
    seen: list[tuple] = []

    def destination(op: str, key: str, meta: dict, length: int) -> memoryview | None:
        seen.append((op, key, meta, length))
        return memoryview(landing) if into_destination else None

    sender = _in_background(lambda: client.send("put", "rank0/step-000000001", {"step": 1}, memoryview(data)))
    message = server.receive(1 << 30, destination)
    sender.join(30)
    assert sender.errors == []
    assert (message.op, message.key, message.meta) == ("put", "rank0/step-000000001", {"step": 1})
    assert seen == [("put", "rank0/step-000000001", {"step": 1}, nbytes)]
    got = np.frombuffer(message.payload, dtype=np.uint8)
    assert got.size == nbytes and np.array_equal(got, data)
    if into_destination:
        assert np.array_equal(landing, data)  # received in place: no bounce buffer
        assert np.shares_memory(np.asarray(message.payload), landing)
    else:  # a fresh mapping faulted in by the kernel, not a bytearray Python zero-fills
        assert isinstance(message.payload, memoryview) and isinstance(message.payload.obj, mmap.mmap)
        assert not message.payload.readonly


def test_fresh_buffers_are_bytearrays_when_small_and_populated_mappings_when_big():
    small = wire.fresh_buffer(wire.MAPPED_BUFFER_MIN_BYTES - 1)
    big = wire.fresh_buffer(wire.MAPPED_BUFFER_MIN_BYTES)
    assert isinstance(small, bytearray) and len(small) == wire.MAPPED_BUFFER_MIN_BYTES - 1
    assert isinstance(big, memoryview) and big.nbytes == wire.MAPPED_BUFFER_MIN_BYTES
    big[-1] = 7  # writable, and tensors viewing it keep it alive
    tensor = torch.frombuffer(big, dtype=torch.uint8)
    del big
    assert tensor[-1].item() == 7 and tensor[:-1].sum().item() == 0


@pytest.mark.parametrize("where", ["payload", "header", "head_tag", "tag", "payload_len"])
def test_tampered_frame_is_rejected(pair, where):
    client, server = pair
    payload = bytearray(secrets.token_bytes(3 * 1024 * 1024))
    head, body, tag = client.seal("put", "rank0/step-000000002", {"step": 2}, memoryview(payload))
    head, body, tag = bytearray(head), bytearray(body), bytearray(tag)
    if where == "payload":
        body[-1] ^= 0x80
    elif where == "header":
        head[wire.PREFIX.size + 20] ^= 0x01  # encrypted: any bit of it
    elif where == "head_tag":
        head[-1] ^= 0x01
    elif where == "tag":
        tag[5] ^= 0x10
    else:
        head[wire.PREFIX.size - 1] ^= 0x01  # payload_len + 1
    landed = bytearray(len(payload) + 1)
    # In the background: the frame outgrows the socket buffers, and a header failure stops reading early.
    _in_background(lambda: client.sock.sendall(head + body + tag + b"\0"))
    with pytest.raises(wire.ChannelError, match=r"message #0 failed its MAC check"):
        server.receive(1 << 30, lambda op, key, meta, n: memoryview(landed)[:n])


def test_a_scattered_payload_is_authenticated_across_its_views(pair):
    # Received into three views (as into training tensors and a gap): every byte is MACed, so a
    # byte flipped in flight at the boundary of two views fails the frame, after ``landed`` saw
    # every piece (what it computed is dropped with the frame).
    client, server = pair
    payload = bytearray(secrets.token_bytes(3 * 1024 * 1024 + 5))
    head, body, tag = client.seal("value", "rank0/step-000000002", {}, memoryview(payload))
    sizes = [1024 * 1024 + 3, 7, len(payload) - 1024 * 1024 - 10]
    views = [memoryview(bytearray(n)) for n in sizes]
    seen: list[int] = []
    scatter = wire.Scatter(views, lambda i, piece: seen.append(i))
    _in_background(lambda: client.sock.sendall(head + body + tag))
    message = server.receive(1 << 30, lambda op, key, meta, n: scatter)
    assert message.payload is scatter and b"".join(bytes(v) for v in views) == bytes(payload)
    assert seen == [0, 0, 1, 2, 2]  # 1 MiB pieces within each view
    head, body, tag = client.seal("value", "rank0/step-000000004", {}, memoryview(payload))
    body = bytearray(body)
    body[sizes[0]] ^= 0x01  # the first byte of the second view, in flight
    _in_background(lambda: client.sock.sendall(head + body + tag))
    with pytest.raises(wire.ChannelError, match=r"message #1 failed its MAC check"):
        server.receive(1 << 30, lambda op, key, meta, n: wire.Scatter([memoryview(bytearray(n))]))


def test_replayed_and_reordered_frames_are_rejected(pair):
    client, server = pair
    first = b"".join(client.seal("put", "k", {"n": 0}, memoryview(b"zero")))
    client.sock.sendall(first)
    assert server.receive(1 << 20).meta == {"n": 0}
    client.sock.sendall(first)  # replay: the server expects #1 now
    with pytest.raises(wire.ChannelError, match=r"message #1 failed its MAC check"):
        server.receive(1 << 20)

    client2, server2 = _fresh_pair()
    a = b"".join(client2.seal("put", "k", {"n": 0}, memoryview(b"zero")))
    b = b"".join(client2.seal("put", "k", {"n": 1}, memoryview(b"one")))
    with client2.sock, server2.sock:
        client2.sock.sendall(b + a)  # reordered
        with pytest.raises(wire.ChannelError, match=r"message #0 failed its MAC check"):
            server2.receive(1 << 20)


def test_frame_reflected_back_to_its_sender_is_rejected(pair):
    """The direction is in the IV: a client's own frame echoed to it does not verify."""
    client, server = pair
    server.sock.sendall(b"".join(client.seal("ok", "k", {}, memoryview(b"x"))))
    with pytest.raises(wire.ChannelError, match="failed its MAC check"):
        client.receive(1 << 20)


def test_wrong_key_is_rejected():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(10.0)
        b.settimeout(10.0)
        sender = wire.Session(a, secrets.token_bytes(32), send_tag=C2S, recv_tag=S2C)
        receiver = wire.Session(b, secrets.token_bytes(32), send_tag=S2C, recv_tag=C2S)
        sender.send("put", "k", {}, memoryview(b"payload"))
        with pytest.raises(wire.ChannelError, match="message #0 failed its MAC check"):
            receiver.receive(1 << 20)


def test_tags_differ_per_sequence_number_and_direction():
    key = secrets.token_bytes(32)
    one = wire.Session(None, key, send_tag=C2S, recv_tag=S2C)  # type: ignore[arg-type]  # seal() only
    other = wire.Session(None, key, send_tag=S2C, recv_tag=C2S)  # type: ignore[arg-type]
    frames = [one.seal("put", "k", {}, memoryview(b"same")) for _ in range(3)] + [
        other.seal("put", "k", {}, memoryview(b"same"))
    ]
    assert len({head for head, _, _ in frames}) == 4  # the encrypted headers and their tags differ
    assert len({body for _, body, _ in frames}) == 4  # so do the encrypted payloads of one plaintext
    assert len({tag for _, _, tag in frames}) == 4
    assert all(len(tag) == wire.TAG_BYTES for _, _, tag in frames)


def test_discarded_payload_is_authenticated_and_the_stream_stays_in_step(pair):
    client, server = pair
    big = _random(5 * 1024 * 1024 + 3)
    sender = _in_background(
        lambda: [client.send("put", "a", {}, memoryview(big)), client.send("put", "b", {}, memoryview(b"next"))]
    )
    dropped = server.receive(1 << 30, lambda *_: wire.DISCARD)
    kept = server.receive(1 << 30)
    sender.join(30)
    assert sender.errors == []
    assert (dropped.key, len(dropped.payload)) == ("a", 0)
    assert (kept.key, bytes(kept.payload)) == ("b", b"next")


def test_destination_of_the_wrong_size_is_refused(pair):
    client, server = pair
    client.send("put", "k", {}, memoryview(b"12345"))
    with pytest.raises(wire.ChannelError, match="destination for key 'k' is not 5 bytes long"):
        server.receive(1 << 20, lambda *_: memoryview(bytearray(4)))


def test_no_pickle_on_the_wire():
    sources = sorted(pathlib.Path(wire.__file__).parent.glob("*.py"))  # the whole channel package
    assert len(sources) >= 5
    for source in sources:
        assert "pickle" not in source.read_text(), source


def _fresh_pair() -> tuple[wire.Session, wire.Session]:
    key = secrets.token_bytes(32)
    a, b = socket.socketpair()
    a.settimeout(10.0)
    b.settimeout(10.0)
    return wire.Session(a, key, send_tag=C2S, recv_tag=S2C), wire.Session(b, key, send_tag=S2C, recv_tag=C2S)
