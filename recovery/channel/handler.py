"""What a replication channel server stores into and serves from: the handler's side of
``resilient.recovery.channel.server`` (the RAM tier's is ``ram.buddy.BuddyHandler``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class ChannelHandler(Protocol):
    """What the server stores into and serves from (the RAM tier's buddy store)."""

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        """Called only after the whole message arrived and its MAC verified; the buffer is the handler's."""
        ...

    def get(self, requester_rank: int, key: str) -> tuple[dict, bytes | memoryview] | None:
        """The held header and payload of ``key``, or None when it is not held here."""
        ...


@dataclass(frozen=True, slots=True)
class PutTarget:
    """Where a put's payload is received (the handler's own memory), and how the put ends.

    ``buffer`` receives bytes that are NOT yet authenticated: the handler must not publish or read
    them until ``commit``. Exactly one of ``commit`` (the whole payload arrived and its MAC verified)
    or ``abort`` (MAC failure, timeout, peer gone, server closing) is called; if ``commit`` raises,
    the handler cleans up itself and the client gets an ``error`` reply naming the exception.
    """

    buffer: memoryview  # writable, C-contiguous, exactly the payload's size
    commit: Callable[[], None]
    abort: Callable[[], None]
    landed: Callable[[memoryview], None] | None = None
    """Sees each piece of ``buffer`` as it arrives, in order, before the MAC is checked (to
    checksum it while it is in cache); what it computes counts only at ``commit``."""


class DirectPutHandler(ChannelHandler, Protocol):
    """A handler that has puts received straight into its memory (no bounce buffer, no extra copy).

    The server uses ``reserve_put`` instead of ``put`` when the handler has it.
    """

    def reserve_put(self, sender_rank: int, key: str, header: dict, nbytes: int) -> PutTarget:
        """Called once the message header is authenticated, before its payload arrives; raise to refuse
        the put (the payload is then read and dropped, and the client gets an ``error`` reply)."""
        ...
