"""Who may contribute to a quorum: every member must prove, over our channel, that it holds the job secret.

torchft 0.2.0's lighthouse takes anyone who reaches its port as a replica group: a stranger could
join the cross-group gradient all-reduce (a SUM) or take participating rank 0 (the group that
writes checkpoints). It has no authentication hook, so the check is built around it:

- every group registers a replica id that names where it proves itself:
  ``group<G:05d>:auth.<host and port, base64url>.g<G>`` (torchft appends ``:<uuid>``). The prefix
  before the first ``:`` stays ``group<G:05d>`` (torchft ranks replicas by it and reads the group
  from its digits), and the id still ends with the group's digits (torchft's global rank);
- the address is the group rank 0's heal server (``transport``): the authenticated channel, whose
  mutual HMAC handshake proves the server holds the job secret. Asked ``PROOF_KEY``, it answers with
  its group's full replica id and the store address it registered, so a stranger naming a real
  group's server in its own id gains nothing (the answer names another member), nor does one that
  registers under a real member's id with its own store: a proof holds for the (id, store) pair,
  and every rank refuses a quorum whose store (where torchft's cross-group rendezvous meets) no
  proven member registered;
- after every quorum whose members changed, rank 0 of each group checks each other member (a
  proof is remembered per (member id, store): a restarted group has a new uuid, so a new id; a member that
  failed is asked again at the next step) and the group agrees on the outcome. While any member
  cannot prove itself, the group sends nothing across groups and votes not to commit: the step is
  discarded by every real group, and an event names the member. (A stranger that stays only
  stalls the job: denial of service is out of scope.)
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import logging

from resilient.recovery.channel import ChannelError, ReplicationClient

log = logging.getLogger(__name__)

PROOF_KEY = "quorum/whoami"
_TAG = "auth."


def member_id(group: int, host: str, port: int) -> str:
    """The replica id a group registers (torchft appends ``:<uuid>``)."""
    where = base64.urlsafe_b64encode(f"{host} {port}".encode()).decode().rstrip("=")
    return f"group{group:05d}:{_TAG}{where}.g{group}"


def proof_address(member: str) -> tuple[str, int] | None:
    """Where ``member`` (a full replica id) says it proves itself; None when it names no place."""
    parts = member.split(":")
    if len(parts) < 2 or not parts[1].startswith(_TAG):
        return None
    encoded = parts[1][len(_TAG) :].rpartition(".g")[0]
    try:
        host, _, port = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode().rpartition(" ")
        return (host, int(port)) if host else None
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None


class MemberCheck:
    """Rank 0's side: which quorum members cannot prove they hold the job secret, and why."""

    def __init__(self, secret: bytes, *, rank: int, timeout_s: float) -> None:
        self._secret, self._rank, self._timeout_s = secret, rank, timeout_s
        self._proven: set[tuple[str, str]] = set()

    def stores(self, members: list[str]) -> list[str]:
        """The store addresses the proven ``members`` registered (sorted)."""
        return sorted({store for member, store in self._proven if member in members})

    def unproven(self, members: list[str], own: str) -> dict[str, str]:
        """``{member: why}`` for every member but ``own`` that cannot prove itself (checked in
        parallel; a member that proved itself once is not asked again)."""
        known = {member for member, _ in self._proven}
        todo = [m for m in members if m != own and m not in known]
        unproven: dict[str, str] = {}
        if todo:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
                for member, (reason, store) in zip(todo, pool.map(self._prove, todo), strict=True):
                    if reason is None:
                        self._proven.add((member, store))
                    else:  # not remembered: a member whose server was busy may prove itself next time
                        unproven[member] = reason
        return unproven

    def _prove(self, member: str) -> tuple[str | None, str]:
        """Why ``member`` is not proven (None when it is), and the store address it proved."""
        address = proof_address(member)
        if address is None:
            return "its replica id names no place where it proves the job secret (not started by this job)", ""
        try:
            with ReplicationClient(self._secret, address, rank=self._rank, timeout_s=self._timeout_s) as client:
                held = client.get(PROOF_KEY)
        except (ChannelError, OSError) as e:
            return f"no proof of the job secret from {address[0]}:{address[1]}: {e}", ""
        answer = held[0] if held is not None else {}
        claimed = answer.get("replica_id")
        if claimed != member:
            return f"{address[0]}:{address[1]} proves the job secret for {claimed!r}, not for this member", ""
        store = answer.get("store_address")
        if not isinstance(store, str) or not store:
            return f"{address[0]}:{address[1]} proves the job secret but names no store address", ""
        return None, store
