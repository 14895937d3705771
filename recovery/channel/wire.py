"""The replication channel's wire format: framing, message encryption (AES-GCM) and the mutual handshake.

Protocol, version 3 (integers big-endian, ``|`` is concatenation, ``sn``/``cn`` are 32-byte nonces)::

    S -> C  MAGIC(8) | sn
    C -> S  rank(i64) | cn | HMAC(secret, "resilient/channel/v3/client" | sn | cn | rank)
    S -> C  max_message_bytes(u64) | HMAC(secret, "resilient/channel/v3/server" | sn | cn | rank | max)
    then messages both ways:
            prefix | E(header) | head_tag(16) | E(payload) | tag(16)
            prefix   = header_len(u32) | payload_len(u64); header = JSON {"op","key","meta"}
            E(header), head_tag = AES-GCM(K, nonce(direction, 2 seq),     aad=prefix,          header)
            E(payload), tag     = AES-GCM(K, nonce(direction, 2 seq + 1), aad=prefix | header, payload)
            K        = HMAC(secret, "resilient/channel/v3/session" | sn | cn | rank)   (AES-256 key)
            nonce(d, n) = d(4) | n(u64)   (the 96-bit GCM IV)

- Both sides pick a fresh nonce, so neither proof can be replayed; distinct domain tags stop a proof
  being reflected back. A bad client proof makes the server close without answering; the client
  checks the server's proof before it sends any data, so it never hands a snapshot to an impostor.
- Messages are authenticated and encrypted (AES-256-GCM, NIST SP 800-38D, through ``cryptography``):
  a stranger on the network can neither read nor change a snapshot, a heal or their headers (the
  snapshot index carries the data cursor and RNG state). With AES-NI and carry-less multiply GCM
  costs about the pass its authentication alone (GMAC) cost before (``benchmarks/ram_bench.py``:
  the ``ram_mac`` lines). GCM must never reuse an IV under one key: K is fresh per connection and
  the IV is (direction, per-direction counter), so every IV is used once.
- ``direction`` is ``c2s`` or ``s2c``; ``seq`` counts messages per direction from 0 and is NOT sent:
  the receiver uses the number it expects, so a replayed, dropped or reordered message fails its MAC,
  and the per-connection key K makes a message recorded on one connection worthless on another.
- The receiver refuses ``header_len`` > 1 MiB or ``payload_len`` > ``max_message_bytes`` before reading
  them, and checks ``head_tag`` before it parses the header. Only then does it choose where the
  payload lands (``destination``: e.g. a store slot, no bounce buffer), and it decrypts each chunk
  into its place as it arrives (received into a 1 MiB scratch buffer, still in cache). A
  destination may also be a ``Scatter``: views filled one
  after another (a buddy's copy received straight into the training tensors), with a hook that sees
  each piece as it lands (to checksum it while in cache). The payload
  counts as the sender's only once ``tag`` verifies: a destination must not publish it before
  ``receive`` returns.

Nothing here opens, accepts or serves a connection (``resilient.recovery.channel.server`` does); this
module turns bytes on a connected socket into authenticated messages and back.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import mmap
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    AEADEncryptionContext,
    Cipher,
    algorithms,
    modes,
)

from resilient.errors import ConfigError, StorageError

MAGIC = b"RSLCHAN3"
_NONCE_BYTES = 32
_MAC_BYTES = 32  # HMAC-SHA256 proofs in the handshake
TAG_BYTES = 16  # GCM tags on messages
_MIN_SECRET_BYTES = 16  # an HMAC key shorter than this is guessable; token_bytes(32) is the norm
GREETING = struct.Struct(f">8s{_NONCE_BYTES}s")
HELLO = struct.Struct(f">q{_NONCE_BYTES}s{_MAC_BYTES}s")
WELCOME = struct.Struct(f">Q{_MAC_BYTES}s")
PREFIX = struct.Struct(">IQ")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")
_MAX_HEADER_BYTES = 1 << 20
_CHUNK_BYTES = 1 << 20  # sendall's timeout covers the whole call, so big payloads go out in chunks
_THROTTLE_SLICE_S = 0.1  # a throttled chunk is ~0.1 s of traffic, so the receiver never waits long
_MIN_THROTTLE_CHUNK = 4096
_TAG_CLIENT = b"resilient/channel/v3/client"
_TAG_SERVER = b"resilient/channel/v3/server"
_TAG_SESSION = b"resilient/channel/v3/session"
_CLIENT_TO_SERVER = b"c2s\0"  # 4 bytes: with the u64 counter, the 12-byte GCM IV
_SERVER_TO_CLIENT = b"s2c\0"
EMPTY = memoryview(b"")
DISCARD = memoryview(bytearray(0))  # a destination that reads, authenticates and drops the payload


class ChannelError(StorageError):
    """The replication channel refused, lost or timed out a connection or message (names peer and key)."""


class PeerClosed(ChannelError):
    """The peer closed the connection; the handshake rephrases it (a refusal looks exactly like this)."""


class OversizedMessage(ChannelError):
    """A declared length is over the limit; the server answers once and closes, the payload unread."""


@dataclass(frozen=True, slots=True)
class Message:
    op: str
    key: str
    meta: dict
    payload: bytearray | memoryview | Scatter
    """Fresh memory of its own (fresh_buffer), or the destination it was received into."""


@dataclass(frozen=True, slots=True)
class Scatter:
    """A payload received into several writable byte views, in order (their sizes add up to it).
    ``landed(i, piece)`` is called with each piece of view ``i`` as it arrives, after it is added
    to the MAC and before the MAC is checked: what it computes counts only if ``receive`` returns."""

    views: list[memoryview]
    landed: Callable[[int, memoryview], None] | None = None


Destination = Callable[[str, str, dict, int], "memoryview | Scatter | None"]
"""``(op, key, meta, payload_len)`` of an authenticated header -> a writable byte view of exactly
``payload_len`` bytes to receive the payload into, or a ``Scatter``; None for fresh memory
(``fresh_buffer``), ``DISCARD`` to drop it."""


def check_secret(secret: bytes) -> bytes:
    """``secret`` as bytes, if it is long enough to be an HMAC key."""
    if not isinstance(secret, bytes | bytearray) or len(secret) < _MIN_SECRET_BYTES:
        raise ConfigError(
            f"secret must be bytes of at least {_MIN_SECRET_BYTES} (use secrets.token_bytes(32) from the rendezvous)"
        )
    return bytes(secret)


def check_positive(name: str, value: float) -> None:
    """A channel end's timeout must be > 0 seconds."""
    if not value > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")


def byte_view(data: bytes | bytearray | memoryview, key: str) -> memoryview:
    """A flat byte view of ``data`` without copying it (tensors' memoryviews may be typed or N-D)."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ConfigError(f"payload for key {key!r} is not C-contiguous; pass a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _proof(secret: bytes, tag: bytes, server_nonce: bytes, client_nonce: bytes, rank: int, extra: bytes = b"") -> bytes:
    return hmac.new(secret, tag + server_nonce + client_nonce + _I64.pack(rank) + extra, hashlib.sha256).digest()


def describe(error: BaseException) -> str:
    """A socket error in words for a ChannelError message (a timeout's own text is empty)."""
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
            raise PeerClosed(f"peer closed the connection during {what} ({received} of {view.nbytes} bytes arrived)")
        received += count


def _recv_struct(sock: socket.socket, layout: struct.Struct, what: str, deadline: float | None = None) -> tuple:
    buffer = bytearray(layout.size)
    _recv_exactly(sock, memoryview(buffer), what, deadline)
    return layout.unpack(buffer)


def _send_payload(
    sock: socket.socket, payload: memoryview, bytes_per_s: float, encrypt: Callable[[memoryview], memoryview]
) -> None:
    """Send ``payload`` in chunks, each encrypted just before it goes out (one pass over memory)."""
    chunk = _CHUNK_BYTES
    if bytes_per_s > 0:
        chunk = int(min(_CHUNK_BYTES, max(_MIN_THROTTLE_CHUNK, bytes_per_s * _THROTTLE_SLICE_S)))
    start = time.monotonic()
    for offset in range(0, payload.nbytes, chunk):
        piece = payload[offset : offset + chunk]
        sock.sendall(encrypt(piece))
        if bytes_per_s > 0:
            # Sleep until the bytes sent so far fit the budget, so the average rate never exceeds it
            # and the training job's own traffic keeps its share of the NIC.
            delay = start + (offset + piece.nbytes) / bytes_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def encode_header(op: str, key: str, meta: dict) -> bytes:
    """A message header as sent; ConfigError for one that is not JSON or over the size limit."""
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
        raise ChannelError(f"authenticated message has a malformed header: {describe(e)}") from e
    if not (isinstance(op, str) and isinstance(key, str) and isinstance(meta, dict)):
        raise ChannelError("authenticated message has a malformed header: op/key/meta have wrong types")
    return op, key, meta


def _chunks(view: memoryview) -> list[memoryview]:
    return [view[offset : offset + _CHUNK_BYTES] for offset in range(0, view.nbytes, _CHUNK_BYTES)]


class Session:
    """One authenticated, encrypted connection: its key and the two implicit sequence numbers."""

    def __init__(self, sock: socket.socket, key: bytes, *, send_tag: bytes, recv_tag: bytes) -> None:
        self.sock = sock
        self._cipher = algorithms.AES(key)
        self._send_tag, self._recv_tag = send_tag, recv_tag
        self._send_seq = self._recv_seq = 0

    def __repr__(self) -> str:  # never the key
        return f"Session(sent={self._send_seq}, received={self._recv_seq})"

    def _gcm(self, direction: bytes, counter: int, *, encrypt: bool) -> AEADEncryptionContext | AEADDecryptionContext:
        mode = Cipher(self._cipher, modes.GCM(direction + _U64.pack(counter)))
        return mode.encryptor() if encrypt else mode.decryptor()

    def _open_frame(self, op: str, key: str, meta: dict, payload_bytes: int) -> tuple[bytes, AEADEncryptionContext]:
        """The frame's head (prefix, encrypted header, its tag) and the payload's encryptor."""
        header = encode_header(op, key, meta)
        prefix = PREFIX.pack(len(header), payload_bytes)
        seq, self._send_seq = self._send_seq, self._send_seq + 1
        head = self._gcm(self._send_tag, 2 * seq, encrypt=True)
        head.authenticate_additional_data(prefix)
        sealed = head.update(header) + head.finalize()
        body = self._gcm(self._send_tag, 2 * seq + 1, encrypt=True)
        body.authenticate_additional_data(prefix + header)
        return prefix + sealed + head.tag, body

    def seal(self, op: str, key: str, meta: dict, payload: memoryview = EMPTY) -> tuple[bytes, bytes, bytes]:
        """Frame one message as (head, encrypted payload, tag): what ``send`` puts on the wire."""
        head, body = self._open_frame(op, key, meta, payload.nbytes)
        sealed = body.update(bytes(payload)) + body.finalize()
        return head, sealed, body.tag

    def send(self, op: str, key: str, meta: dict, payload: memoryview = EMPTY, bytes_per_s: float = 0.0) -> None:
        """Send one message; the payload is encrypted chunk by chunk as it goes out (one pass over it)."""
        head, body = self._open_frame(op, key, meta, payload.nbytes)
        self.sock.sendall(head)
        scratch = memoryview(bytearray(min(payload.nbytes, _CHUNK_BYTES)))

        def encrypt(piece: memoryview) -> memoryview:
            return scratch[: body.update_into(piece, scratch)]

        _send_payload(self.sock, payload, bytes_per_s, encrypt)
        body.finalize()
        self.sock.sendall(body.tag)

    def receive(self, max_payload_bytes: int, destination: Destination | None = None) -> Message:
        """The next message, authenticated and decrypted; its payload lands where ``destination``
        says (see Destination). On any error the destination's bytes are garbage: the caller discards them.
        """
        prefix = bytearray(PREFIX.size)
        _recv_exactly(self.sock, memoryview(prefix), "a message prefix")
        header_len, payload_len = PREFIX.unpack(prefix)
        # Lengths are checked before reading: an oversized declaration must not make us allocate it.
        if header_len > _MAX_HEADER_BYTES:
            raise OversizedMessage(f"declared header of {header_len} bytes exceeds the {_MAX_HEADER_BYTES} limit")
        if payload_len > max_payload_bytes:
            raise OversizedMessage(
                f"declared payload of {payload_len} bytes exceeds max_message_bytes={max_payload_bytes}"
            )
        seq = self._recv_seq
        sealed = bytearray(header_len + TAG_BYTES)
        _recv_exactly(self.sock, memoryview(sealed), "a message header")
        head = self._gcm(self._recv_tag, 2 * seq, encrypt=False)
        head.authenticate_additional_data(prefix)
        header = head.update(bytes(sealed[:header_len]))
        self._finish(head, bytes(sealed[header_len:]))
        op, key, meta = _decode_header(header)
        view = destination(op, key, meta, payload_len) if destination is not None else None
        payload = fresh_buffer(payload_len) if view is None else view
        body = self._gcm(self._recv_tag, 2 * seq + 1, encrypt=False)
        body.authenticate_additional_data(prefix + header)
        scratch = memoryview(bytearray(min(payload_len, _CHUNK_BYTES)))
        if view is DISCARD:
            self._recv_discarding(payload_len, body, scratch)
        else:
            scatter = payload if isinstance(payload, Scatter) else Scatter([memoryview(payload)])
            if sum(view.nbytes for view in scatter.views) != payload_len:
                raise ChannelError(f"destination for key {key!r} is not {payload_len} bytes long")
            for i, view in enumerate(scatter.views):
                landed = functools.partial(scatter.landed, i) if scatter.landed is not None else None
                self._recv_decrypting(view, body, scratch, landed)
        tag = bytearray(TAG_BYTES)
        _recv_exactly(self.sock, memoryview(tag), "a message MAC")
        self._finish(body, bytes(tag))
        self._recv_seq += 1
        return Message(op, key, meta, payload)

    def _finish(self, context: AEADDecryptionContext, tag: bytes) -> None:
        try:
            context.finalize_with_tag(tag)
        except InvalidTag:
            raise ChannelError(
                f"message #{self._recv_seq} failed its MAC check (tampered, replayed or reordered)"
            ) from None

    def _recv_decrypting(
        self,
        view: memoryview,
        body: AEADDecryptionContext,
        scratch: memoryview,
        landed: Callable[[memoryview], None] | None = None,
    ) -> None:
        # Each chunk lands in a small scratch buffer (in cache) and is decrypted into its place.
        for offset in range(0, view.nbytes, _CHUNK_BYTES):
            piece = view[offset : offset + _CHUNK_BYTES]
            cipher = scratch[: piece.nbytes]
            _recv_exactly(self.sock, cipher, f"a payload (its chunk at byte {offset} of {view.nbytes})")
            body.update_into(cipher, piece)
            if landed is not None:
                landed(piece)

    def _recv_discarding(self, nbytes: int, body: AEADDecryptionContext, scratch: memoryview) -> None:
        plain = memoryview(bytearray(scratch.nbytes))
        for offset in range(0, nbytes, _CHUNK_BYTES):
            piece = scratch[: min(_CHUNK_BYTES, nbytes - offset)]
            _recv_exactly(self.sock, piece, f"a payload (its chunk at byte {offset} of {nbytes})")
            body.update_into(piece, plain[: piece.nbytes])


MAPPED_BUFFER_MIN_BYTES = 8 << 20
"""From this size on a received payload lands in a fresh anonymous mapping faulted in whole by the
kernel (``MAP_POPULATE``) instead of a ``bytearray``, which Python zero-fills page fault by page
fault: faster for a buddy's snapshot fetched at restore (``ram_bench``'s ``ram_buddy_s``).
Transparent huge pages (``MADV_HUGEPAGE``) are not used: faster alone, slower in a rank holding its
training state (direct compaction). Figures: benchmarks/README.md, "Choices in the code"."""


def fresh_buffer(nbytes: int) -> bytearray | memoryview:
    """Writable memory for ``nbytes`` received bytes: a memoryview over a private anonymous mapping
    for big payloads (the view keeps the mapping alive, and ``torch.frombuffer`` on it keeps the
    view alive), a bytearray for small ones."""
    if nbytes < MAPPED_BUFFER_MIN_BYTES:
        return bytearray(nbytes)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(-1, nbytes, flags=flags))


def client_handshake(sock: socket.socket, secret: bytes, rank: int, timeout_s: float) -> tuple[Session, int]:
    """Prove the secret to the server and make it prove it back; returns the session and its size limit."""
    deadline = time.monotonic() + timeout_s
    magic, server_nonce = _recv_struct(sock, GREETING, "the server greeting", deadline)
    if magic != MAGIC:
        raise ChannelError("peer is not a replication channel server (unexpected greeting)")
    client_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(HELLO.pack(rank, client_nonce, _proof(secret, _TAG_CLIENT, server_nonce, client_nonce, rank)))
    try:
        max_bytes, server_proof = _recv_struct(sock, WELCOME, "the server's proof", deadline)
    except PeerClosed as e:
        raise ChannelError(
            "server closed the connection after our proof: it refused us, so this process's job secret "
            "differs from the server's (check that both got it from the same rendezvous)"
        ) from e
    expected = _proof(secret, _TAG_SERVER, server_nonce, client_nonce, rank, _U64.pack(max_bytes))
    if not hmac.compare_digest(expected, server_proof):
        raise ChannelError("server failed to prove it knows the job secret; no data was sent to it")
    sock.settimeout(timeout_s)
    key = _proof(secret, _TAG_SESSION, server_nonce, client_nonce, rank)
    return Session(sock, key, send_tag=_CLIENT_TO_SERVER, recv_tag=_SERVER_TO_CLIENT), max_bytes


def server_handshake(
    sock: socket.socket, secret: bytes, max_message_bytes: int, timeout_s: float
) -> tuple[Session, int]:
    """Check the client's proof (closing on failure, without answering) and prove the secret back."""
    deadline = time.monotonic() + timeout_s
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(GREETING.pack(MAGIC, server_nonce))
    rank, client_nonce, client_proof = _recv_struct(sock, HELLO, "the client hello", deadline)
    if not hmac.compare_digest(_proof(secret, _TAG_CLIENT, server_nonce, client_nonce, rank), client_proof):
        raise ChannelError(f"handshake refused: proof of claimed rank {rank} does not match the job secret")
    limit = _U64.pack(max_message_bytes)
    sock.sendall(WELCOME.pack(max_message_bytes, _proof(secret, _TAG_SERVER, server_nonce, client_nonce, rank, limit)))
    sock.settimeout(timeout_s)
    key = _proof(secret, _TAG_SESSION, server_nonce, client_nonce, rank)
    return Session(sock, key, send_tag=_SERVER_TO_CLIENT, recv_tag=_CLIENT_TO_SERVER), rank
