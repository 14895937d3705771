"""torchft's HTTP checkpoint transport, counting what a heal receives (bytes and seconds).

Same wire behaviour as ``torchft.checkpointing.HTTPTransport`` (one GET of the whole state per group
rank). Caveat (ENV-NOTES): it advertises ``http://<socket.gethostname()>:PORT`` whatever the
Manager's hostname argument says; the hostname must resolve to an address peers can reach.
"""

from __future__ import annotations

import io
import time
import urllib.request
from datetime import timedelta

from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport


class _CountingReader(io.RawIOBase):
    def __init__(self, response: io.RawIOBase) -> None:
        self._response = response
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self._response.read(len(buffer))
        buffer[: len(data)] = data
        self.count += len(data)
        return len(data)


class CountingHTTPTransport(HTTPTransport):
    """Records the size and duration of the last checkpoint this process received."""

    last_recv_bytes: int = 0
    last_recv_s: float = 0.0

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        start = time.perf_counter()
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as response:
            reader = _CountingReader(response)
            # Pickle, as torchft does: peers are trusted members of the same job.
            state = _streaming_load(io.BufferedReader(reader), weights_only=False)
        cls.last_recv_bytes = reader.count
        cls.last_recv_s = time.perf_counter() - start
        return state
