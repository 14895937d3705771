"""The heal transport: state round-trips without pickle, strangers get nothing, tampering is caught.

Real components: two ``HealTransport``s on loopback (the authenticated channel's server and client),
a stranger speaking raw TCP/HTTP to the advertised address, and a TCP proxy that flips a byte.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import pickle
import secrets
import socket
import threading
import urllib.request
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from resilient.errors import IntegrityError, ResilientError
from resilient.recovery import transport as transport_module
from resilient.recovery.channel import ChannelError, wire
from resilient.recovery.heal_codec import LocalShard, adopt_shards, decode_state, encode_state
from resilient.recovery.transport import HealTransport

TIMEOUT = timedelta(seconds=10)
MARKER = b"HEAL-STATE-MARKER-"


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "user": {
            "default": {
                "model": {"w": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16)},
                "optim": {
                    "state": {"layers.0.w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4).double()}},
                    "param_groups": [{"lr": 0.1, "params": ["layers.0.w"], "betas": [0.9, 0.95]}],
                },
                "data": {"cursor": 5, "nested": {"a": [1, 2.5, {"b": None, "c": "text"}]}},
                "listed": [torch.arange(4, dtype=torch.int64), {"x": torch.zeros(0, 3)}],
                "marker": torch.frombuffer(bytearray(MARKER * 64), dtype=torch.uint8),
            }
        },
        "torchft": {"step": 7, "batches_committed": 14},
    }


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.fixture
def pair():
    secret = secrets.token_bytes(32)
    source = HealTransport(secret, rank=1, host="127.0.0.1", timeout=TIMEOUT)
    healer = HealTransport(secret, rank=1, host="127.0.0.1", timeout=TIMEOUT)
    yield source, healer
    source.shutdown()
    healer.shutdown()


def _forbid_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the heal path unpickled something")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mapped", [False, True], ids=["bytearray", "mapping"])
def test_state_round_trips_without_pickle(pair, monkeypatch: pytest.MonkeyPatch, mapped: bool) -> None:
    if mapped:  # received into an anonymous mapping, as heal payloads of 8 MiB and more are
        monkeypatch.setattr(wire, "MAPPED_BUFFER_MIN_BYTES", 1)
    kinds: list[type] = []
    real_decode = transport_module.decode_state
    monkeypatch.setattr(transport_module, "decode_state", lambda p, **k: kinds.append(type(p)) or real_decode(p, **k))
    source, healer = pair
    state = _state()
    payload = encode_state(state)
    assert payload[:1] != b"\x80" and payload[:2] != b"PK"  # neither a pickle nor torch.save's zip
    source.send_checkpoint([0], step=7, state_dict=state, timeout=TIMEOUT)
    _forbid_pickle(monkeypatch)
    received = healer.recv_checkpoint(src_rank=0, metadata=source.metadata(), step=7, timeout=TIMEOUT)
    _assert_same(state, received)
    assert healer.last_recv_bytes == len(payload) and healer.last_recv_s > 0
    assert kinds == [memoryview if mapped else bytearray]


@pytest.mark.timeout(30)
def test_state_is_a_copy_and_withdrawn_after_disallow(pair) -> None:
    source, healer = pair
    state = _state()
    source.send_checkpoint([0], step=7, state_dict=state, timeout=TIMEOUT)
    state["user"]["default"]["model"]["w"].add_(1.0)  # the trainer moves on; the heal sends step 7
    received = healer.recv_checkpoint(src_rank=0, metadata=source.metadata(), step=7, timeout=TIMEOUT)
    assert torch.equal(received["user"]["default"]["model"]["w"] + 1.0, state["user"]["default"]["model"]["w"])
    source.disallow_checkpoint()
    healer._timeout = timedelta(seconds=1)
    source._handler._timeout_s = 0.5
    with pytest.raises(ChannelError, match="not serving"):
        healer.recv_checkpoint(src_rank=0, metadata=source.metadata(), step=7, timeout=TIMEOUT)


@pytest.mark.timeout(60)
def test_dtensor_shards_travel_and_land_on_the_receivers_mesh(pair) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    source, healer = pair
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.randn(4, 6).to(torch.bfloat16)
        state = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}, "train": {"step": 3}}
        source.send_checkpoint([0], step=3, state_dict=state, timeout=TIMEOUT)
        received = healer.recv_checkpoint(src_rank=0, metadata=source.metadata(), step=3, timeout=TIMEOUT)
        assert isinstance(received["model"]["w"], LocalShard)
        like = {"model": {"w": distribute_tensor(torch.zeros(4, 6, dtype=torch.bfloat16), mesh, [Shard(0)])}}
        adopted = adopt_shards(received, like)
        assert isinstance(adopted["model"]["w"], DTensor) and adopted["model"]["w"].placements == (Shard(0),)
        assert torch.equal(adopted["model"]["w"].full_tensor(), full) and adopted["train"] == {"step": 3}
        wrong = {"model": {"w": distribute_tensor(torch.zeros(4, 5, dtype=torch.bfloat16), mesh, [Shard(0)])}}
        with pytest.raises(ResilientError, match="same parallel layout"):
            adopt_shards(received, wrong)
    finally:
        dist.destroy_process_group()


def _address(transport: HealTransport) -> tuple[str, int]:
    where = json.loads(transport.metadata())
    return where["host"], where["port"]


def _drain(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionError):
        pass
    return out


@pytest.mark.timeout(30)
def test_strangers_get_no_state(pair) -> None:
    source, _ = pair
    source.send_checkpoint([0], step=7, state_dict=_state(), timeout=TIMEOUT)
    host, port = _address(source)
    # torchft's HTTP request for the state: answered with a greeting, then closed, never the state.
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET /checkpoint/7/full HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 200)
        seen = _drain(sock)
    assert MARKER not in seen and len(seen) < 100
    with pytest.raises((OSError, http.client.HTTPException)):  # no HTTP answer at all
        urllib.request.urlopen(f"http://{host}:{port}/checkpoint/7/full", timeout=5).read()
    # The right protocol with the wrong key: refused at the handshake, before any data.
    stranger = HealTransport(secrets.token_bytes(32), rank=1, host="127.0.0.1", timeout=TIMEOUT)
    try:
        with pytest.raises(ChannelError, match="secret"):
            stranger.recv_checkpoint(src_rank=0, metadata=source.metadata(), step=7, timeout=TIMEOUT)
    finally:
        stranger.shutdown()
    assert any("does not match the job secret" in reason for reason in source.rejected)


@pytest.mark.timeout(30)
def test_other_group_rank_is_refused(pair) -> None:
    source, _ = pair
    source.send_checkpoint([0], step=7, state_dict=_state(), timeout=TIMEOUT)
    other = HealTransport(source._secret, rank=0, host="127.0.0.1", timeout=TIMEOUT)
    try:
        with pytest.raises(ChannelError, match="serves heals to group rank 1"):
            other.recv_checkpoint(src_rank=0, metadata=source.metadata(), step=7, timeout=TIMEOUT)
    finally:
        other.shutdown()


class _FlippingProxy:
    """Forwards one connection to ``target``, flipping the server's byte number ``flip_at``."""

    def __init__(self, target: tuple[str, int], flip_at: int) -> None:
        self._target, self._flip_at = target, flip_at
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(self._target)
        threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
        self._pipe(server, client, self._flip_at)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@pytest.mark.timeout(30)
def test_tampered_payload_is_rejected_before_decoding(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    source, healer = pair
    state = _state()
    source.send_checkpoint([0], step=7, state_dict=state, timeout=TIMEOUT)
    decoded: list[object] = []
    monkeypatch.setattr(transport_module, "decode_state", lambda *a, **k: decoded.append(a))
    # Greeting (40) + welcome (40) + reply prefix and header come first; flip a byte of the tensors.
    proxy = _FlippingProxy(_address(source), flip_at=80 + len(encode_state(state)) // 2)
    metadata = json.dumps({"host": proxy.address[0], "port": proxy.address[1]})
    with pytest.raises(ChannelError, match="MAC"):
        healer.recv_checkpoint(src_rank=0, metadata=metadata, step=7, timeout=TIMEOUT)
    assert decoded == []


@pytest.mark.timeout(30)
def test_malformed_index_is_an_integrity_error() -> None:
    payload = encode_state({"w": torch.ones(4)})
    index_len = int.from_bytes(payload[:8], "big")
    index = json.loads(bytes(payload[8 : 8 + index_len]))
    data = payload[-index["nbytes"] :]
    index["tensors"][0]["offset"] = 1 << 20
    raw = json.dumps(index).encode()
    head = -(-(8 + len(raw)) // 64) * 64
    bad = bytearray(len(raw).to_bytes(8, "big") + raw + bytes(head - 8 - len(raw)) + data)
    with pytest.raises(IntegrityError, match="does not fit"):
        decode_state(bad, source="test")
    with pytest.raises(IntegrityError, match="malformed"):
        decode_state(bytearray(pickle.dumps({"w": 1})), source="test")
