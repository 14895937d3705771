"""The replication wire alone, for ``ram_bench.py``: its MAC against HMAC-SHA256 and memcpy, and
one put through the channel over loopback (no tier, no store)."""

from __future__ import annotations

import hashlib
import hmac
import os
import statistics
import time
from functools import partial


def mac_bench(frame_mib: tuple[int, ...] = (4, 16, 64), repeats: int = 5) -> list[dict]:
    """MiB/s over one frame, one core, 1 MiB updates as on the wire: the wire's AES-GCM encryption
    (``gcm_encrypt``, as a send does it: into a 1 MiB scratch buffer) and decryption
    (``gcm_decrypt``, as a receive does it: into the destination), GMAC alone (what the wire did
    before it encrypted), HMAC-SHA256 (before that) and memcpy; interleaved, so a noisy neighbour
    hits every kind alike."""
    import numpy as np

    key = os.urandom(32)
    lines = []
    for mib in frame_mib:
        source = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
        target = np.empty_like(source)
        kinds = {
            "memcpy": partial(np.copyto, target, source),
            "gmac": partial(_gcm, key, memoryview(source), None),
            "gcm_encrypt": partial(_gcm, key, memoryview(source), memoryview(bytearray(1 << 20))),
            "gcm_decrypt": partial(_gcm, key, memoryview(source), memoryview(target), decrypt=True),
            "hmac_sha256": partial(_hmac_sha256, key, memoryview(source)),
        }
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(repeats):
            for name, fn in kinds.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        rates = {f"{name}_mib_per_s": round(mib / statistics.median(t), 1) for name, t in times.items()}
        lines.append({"bench": "ram_mac", "frame_mib": mib, **rates})
    return lines


def channel_bench(mib: int = 256, repeats: int = 5) -> dict:
    """MiB/s of one put over loopback through the channel alone (one process, no tier, no store):
    sent from the caller's memory, received straight into a preallocated buffer (``reserve_put``)."""
    import secrets

    import numpy as np

    from resilient.recovery.channel import PutTarget, ReplicationClient, ReplicationServer

    source = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)

    class _Slot:
        def __init__(self) -> None:
            self.slot = np.zeros_like(source)

        def reserve_put(self, sender_rank: int, key: str, header: dict, nbytes: int) -> PutTarget:
            return PutTarget(memoryview(self.slot)[:nbytes], lambda: None, lambda: None)

        def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
            raise AssertionError("reserve_put is used")

        def get(self, requester_rank: int, key: str) -> None:
            return None

    secret, handler, rates = secrets.token_bytes(32), _Slot(), []
    with (
        ReplicationServer(secret, handler, host="127.0.0.1") as server,
        ReplicationClient(secret, server.address, rank=0) as client,
    ):
        for step in range(repeats):
            start = time.perf_counter()
            client.put(f"rank0/step-{step:09d}", {}, memoryview(source))
            rates.append(mib / (time.perf_counter() - start))
    assert np.array_equal(handler.slot, source)
    return {
        "bench": "ram_channel",
        "mib": mib,
        "median_mib_per_s": round(statistics.median(rates), 1),
        "each": [round(r, 1) for r in rates],
    }


def _hmac_sha256(key: bytes, view: memoryview, chunk: int = 1 << 20) -> bytes:
    mac = hmac.new(key, b"", hashlib.sha256)
    for offset in range(0, view.nbytes, chunk):
        mac.update(view[offset : offset + chunk])
    return mac.digest()


def _gcm(key: bytes, view: memoryview, out: memoryview | None, chunk: int = 1 << 20, *, decrypt: bool = False) -> None:
    """AES-GCM over ``view`` in 1 MiB pieces: authentication only (``out`` None), encryption into
    a scratch buffer reused per piece (as ``Session.send``), or decryption into ``out`` (as
    ``Session.receive``: the tag is not checked here, only the pass is timed)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    cipher = Cipher(algorithms.AES(key), modes.GCM(b"\0" * 12))
    context = cipher.decryptor() if decrypt else cipher.encryptor()
    for offset in range(0, view.nbytes, chunk):
        piece = view[offset : offset + chunk]
        if out is None:
            context.authenticate_additional_data(piece)
        elif decrypt:
            context.update_into(piece, out[offset : offset + piece.nbytes])
        else:
            context.update_into(piece, out[: piece.nbytes])
