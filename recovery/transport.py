"""torchft's checkpoint transport for live heals, over the authenticated replication channel.

torchft's own HTTP transport serves the state as a pickle to anyone who asks and unpickles what it
fetches: a stranger on the network could read a group's weights, or make a healing group run code.
Here the heal is the RAM tier's channel (``recovery.channel``: mutual HMAC handshake with the job's
secret, every message MAC'd) carrying the no-pickle format of ``heal_codec`` (tensors + JSON):

- ``send_checkpoint`` encodes the state into one buffer (a copy: the trainer may change its state
  as soon as ``disallow_checkpoint`` returns) and serves it, only for that step and only to the
  same group rank, which is how torchft pairs ranks;
- ``recv_checkpoint`` fetches it; the channel verifies the whole message's MAC before a byte is
  decoded, and the decoder checks the layout before any tensor is built;
- ``metadata`` (what torchft passes to the healer) is this server's ``{"host", "port"}`` JSON;
  pointing it elsewhere gains nothing: the client checks the server's proof of the secret first.

A request that arrives before ``send_checkpoint`` (the healer may be quicker than its source) waits
for it, up to the transport's timeout, as torchft's HTTP transport does.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta

from torchft.checkpointing.transport import CheckpointTransport

from resilient.errors import ResilientError
from resilient.recovery.channel import ReplicationClient, ReplicationServer
from resilient.recovery.heal_codec import decode_state, encode_state
from resilient.recovery.quorum_auth import PROOF_KEY

log = logging.getLogger(__name__)


def heal_key(step: int) -> str:
    """The channel key under which a source serves the state of ``step``."""
    return f"heal/step-{step:09d}"


class _HealHandler:
    """What the heal server serves: the staged state of one step, to the same group rank only."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self._rank, self._timeout_s = rank, timeout_s
        self._ready = threading.Condition()
        self._step: int | None = None
        self._payload: bytearray | None = None
        self._closing = False
        self.replica_id = ""
        """This group's full replica id, answered to ``PROOF_KEY`` (``quorum_auth``)."""
        self.store_address = ""
        """The store address this group registered with the lighthouse, answered with it."""

    def stage(self, step: int, payload: bytearray) -> None:
        with self._ready:
            self._step, self._payload = step, payload
            self._ready.notify_all()

    def withdraw(self, closing: bool = False) -> None:
        with self._ready:
            self._step, self._payload = None, None
            self._closing = self._closing or closing
            self._ready.notify_all()

    def _serving(self, key: str) -> bool:
        return self._closing or (self._payload is not None and self._step is not None and heal_key(self._step) == key)

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        raise ResilientError(f"the heal server of rank {self._rank} accepts no uploads (key {key!r})")

    def get(self, requester_rank: int, key: str) -> tuple[dict, bytearray] | None:
        if key == PROOF_KEY:  # to any rank of any group: the handshake proved it holds the secret
            return {"replica_id": self.replica_id, "store_address": self.store_address}, bytearray()
        if requester_rank != self._rank:
            raise ResilientError(f"rank {self._rank} serves heals to group rank {self._rank}, not {requester_rank}")
        with self._ready:
            if not self._ready.wait_for(lambda: self._serving(key), self._timeout_s) or self._payload is None:
                raise ResilientError(
                    f"rank {self._rank} is not serving {key!r} (serving step {self._step}) "
                    f"after {self._timeout_s} s: the quorum moved on"
                )
            assert self._payload is not None
            return {"bytes": len(self._payload)}, self._payload


class HealTransport(CheckpointTransport[dict]):
    """Serves this rank's state to a healing peer and fetches a peer's; see the module docstring.

    ``last_recv_bytes`` / ``last_recv_s``: size and duration of the last state this rank received.
    """

    def __init__(self, secret: bytes, *, rank: int, host: str, timeout: timedelta, thread_nice: int = 0) -> None:
        self._secret = secret
        self.rank = rank
        self._timeout = timeout
        self._handler = _HealHandler(rank, timeout.total_seconds())
        self._server = ReplicationServer(
            secret, self._handler, host=host, timeout_s=timeout.total_seconds(), thread_nice=thread_nice
        )
        self._server.start()
        self.last_recv_bytes = 0
        self.last_recv_s = 0.0

    def __repr__(self) -> str:
        return f"HealTransport(rank={self.rank}, address={self._server.address})"

    @property
    def rejected(self) -> list[str]:
        """Why connections to this rank's heal server were refused (never containing the secret)."""
        return self._server.rejected

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    @property
    def replica_id(self) -> str:
        return self._handler.replica_id

    @replica_id.setter
    def replica_id(self, value: str) -> None:
        self._handler.replica_id = value

    @property
    def store_address(self) -> str:
        return self._handler.store_address

    @store_address.setter
    def store_address(self, value: str) -> None:
        self._handler.store_address = value

    def metadata(self) -> str:
        host, port = self._server.address
        return json.dumps({"host": host, "port": port})

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        start = time.perf_counter()
        payload = encode_state(state_dict)
        self._handler.stage(step, payload)
        log.info(
            "[rank %d] serving the state of step %d to healing groups %s (%d bytes, encoded in %.3f s)",
            self.rank,
            step,
            dst_ranks,
            len(payload),
            time.perf_counter() - start,
            extra={"event": "heal_serve", "step": step, "bytes": len(payload)},
        )

    def disallow_checkpoint(self) -> None:
        # The payload is a copy: a send still in flight keeps its own reference, and the trainer's
        # state is free to change at once.
        self._handler.withdraw()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        try:
            where = json.loads(metadata)
            address = (str(where["host"]), int(where["port"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ResilientError(
                f"heal source of replica rank {src_rank} sent unusable metadata {metadata!r:.200}"
            ) from e
        start = time.perf_counter()
        with ReplicationClient(self._secret, address, rank=self.rank, timeout_s=timeout.total_seconds()) as client:
            held = client.get(heal_key(step))
        if held is None:
            raise ResilientError(f"heal source {address[0]}:{address[1]} holds no state of step {step}")
        _, payload = held
        state = decode_state(payload, source=f"replica rank {src_rank} at {address[0]}:{address[1]}, step {step}")
        self.last_recv_bytes = len(payload)
        self.last_recv_s = time.perf_counter() - start
        return state

    def shutdown(self, wait: bool = True) -> None:
        self._handler.withdraw(closing=True)
        self._server.close(timeout_s=5.0 if wait else 0.5)
