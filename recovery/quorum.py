"""Cross-group synchronization through torchft: quorum, gradient all-reduce, commit vote, heal.

A job is several replica groups; each is one torchrun job with ordinary process groups inside.
Across groups only three things travel, through ``torchft.Manager`` over a ``ProcessGroupGloo``
that the Manager rebuilds on every membership change:

- the step's loss-token count and the gradients (summed: see :meth:`ReplicaGroupSync.allreduce_sum`),
- the commit decision (``should_commit``: a step that failed anywhere in this group is discarded
  here, never half-applied),
- on a heal, the whole training state, fetched from a live group's rank of the same group rank.

Not used, on purpose (ENV-NOTES): ``torchft.DistributedDataParallel`` (its comm hook kills the
HEALTHY replica when a peer dies mid-all-reduce) and ``ProcessGroupBabyGloo`` (never commits).
The quorum is synchronous: a restarted group heals inside ``start_step`` and trains that very step
with real gradients, and the state callbacks never race the training thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchft.manager import REPLICA_ID_KEY, Manager, WorldSizeMode
from torchft.process_group import ProcessGroupGloo, ReduceOp

from resilient import dist as rdist
from resilient.errors import QuorumError, QuorumTimeout, ResilientError
from resilient.recovery.config import ReplicaConfig, check_rows_divisible
from resilient.recovery.heal_codec import adopt_shards, has_shards
from resilient.recovery.quorum_auth import MemberCheck, member_id
from resilient.recovery.transport import HealTransport

__all__ = ["ReplicaConfig", "QuorumInfo", "ReplicaGroupSync", "check_rows_divisible", "replica_name"]

log = logging.getLogger(__name__)


def replica_name(group: int) -> str:
    """Zero-padded: torchft ranks replicas by STRING sort of their ids (group10 < group2 otherwise)."""
    return f"group{group:05d}"


@dataclass(slots=True)
class QuorumInfo:
    """What one step's quorum says, the same on every rank of a group."""

    step: int
    """Committed steps so far = index of the step about to run (after a heal: the source's step)."""
    participating_rank: int
    """This group's rank among the participating groups."""
    num_participants: int
    quorum_id: int
    members: list[str]
    """Replica ids in the quorum ('group00001:<uuid>'; a restarted group gets a new uuid)."""
    healed: bool
    """This group's state was just replaced by a live peer's (bytes/seconds in heal_bytes/heal_s)."""
    heal_bytes: int = 0
    heal_s: float = 0.0
    quorum_s: float = 0.0
    unproven: dict[str, str] = field(default_factory=dict)
    """Members that could not prove they hold the job secret, and why (``quorum_auth``): while any
    is in the quorum this group sends nothing across groups and does not commit."""


class _QuorumClient:
    """The Manager's gRPC client, passed through, with two changes to what ``_quorum`` returns.

    It keeps the last quorum (the Manager keeps it in a local only). And it gives every new quorum
    a ``quorum_id`` no earlier one had: the Manager rebuilds the cross-group process group under the
    store prefix ``torchft/<quorum_id>/<group rank>``, and a RESTARTED lighthouse counts quorum ids
    from 1 again. A rebuilt group under a prefix an earlier group used reads that group's stale
    addresses: gloo's connectFullMesh is refused on one side and hangs well past its timeout on
    the other (reproduced; seen as a CI timeout of test_lighthouse_killed_and_restarted_no_split_brain).
    The id given is a hash of the lighthouse's id, the members (their uuids change on every
    restart) and the max step of the round in which this rank first saw them: every member of a
    new quorum sees it first in the same round, at the same max step, so all derive the same id.

    A member can hold a memo of a quorum that looks like the new one but is not: it missed rounds
    (a slow save or heal) in which the others changed quorum, and then the lighthouse restarted and
    handed out the old (id, members) again. The memo is dropped when that shows: the member's last
    quorum call failed (it saw the outage), the lighthouse id went down, or the max step moved by
    more than the one step a round commits. Left: a member that missed exactly one committed round
    (or none) just before a lighthouse restart keeps its memo while the others derive a new id; its
    collectives then fail, and ``ReplicaGroupSync._check_configured`` restarts the group whose mesh
    could not be built, which changes the members and so every id (one group restart, no state lost)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last_quorum: Any = None
        self.lighthouse_quorum_id = -1
        self._first_seen: tuple[int, tuple[str, ...]] | None = None
        self._last_max_step = -1
        self._store_generation = -1

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        try:
            quorum = self._client._quorum(*args, **kwargs)
        except BaseException:
            self._first_seen = None  # the lighthouse may come back as another: trust no memo
            raise
        lighthouse_id, max_step = int(quorum.quorum_id), int(quorum.max_step)
        seen = (lighthouse_id, tuple(sorted(quorum.replica_ids)))
        same = seen == self._first_seen and lighthouse_id >= self.lighthouse_quorum_id
        if not (same and self._last_max_step <= max_step <= self._last_max_step + 1):
            self._first_seen = seen
            self._store_generation = store_generation(*seen, max_step)
        self.lighthouse_quorum_id, self._last_max_step = lighthouse_id, max_step
        quorum.quorum_id = self._store_generation
        self.last_quorum = quorum
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def store_generation(quorum_id: int, members: tuple[str, ...], max_step: int) -> int:
    """A positive 62-bit id for one quorum of one lighthouse lifetime (``_QuorumClient``)."""
    text = json.dumps([quorum_id, list(members), max_step]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2


class ReplicaGroupSync:
    """One rank's view of the cross-group protocol. Every rank of a group builds one, in the same
    order, and calls ``start_step`` / ``allreduce_*`` / ``should_commit`` once per step attempt.

    ``state_dict``/``load_state_dict``: the training state a healing group receives. Its JSON part
    must be identical in every group: the ranks of one group may heal from different groups.
    ``secret`` (``job_secret``, the same in every group) keys the heal channel, which listens on ``host``.

    Structurally a ``resilient.trainer.sync.StepSync``: the trainer's one train step calls
    ``allreduce_sum`` / ``allreduce_gradients`` / ``should_commit`` on it.
    """

    token_count_dtype = torch.float64
    """The loss-token count crosses the groups in float64 (exact below 2**53; the trainer's step
    sums it in this dtype over dp_shard too, then normalizes the loss by it in float32)."""

    def __init__(
        self,
        config: ReplicaConfig,
        *,
        group: int,
        rank: int,
        world_size: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        secret: bytes,
        host: str,
    ) -> None:
        self.config = config
        self.group = group
        self.rank = rank
        self._user_state = state_dict
        self._load_user_state = load_state_dict
        # Heals travel over the authenticated channel, never torchft's pickle-over-HTTP (``transport``).
        self.transport = HealTransport(secret, rank=rank, host=host, timeout=timedelta(seconds=config.timeout_s))
        self._members = MemberCheck(secret, rank=rank, timeout_s=config.connect_timeout_s)
        self._checked: list[str] | None = None
        self._unproven: dict[str, str] = {}
        self._stores: list[str] = []
        self._store_refused: dict[str, str] = {}
        """The store addresses proven members registered (rank 0 proves them; every rank holds them)."""
        self._healed_now = False
        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=config.collective_timeout_s)),
            load_state_dict=self._on_heal,
            state_dict=state_dict,
            min_replica_size=config.min_replica_size,
            use_async_quorum=False,
            replica_id=member_id(group, *self.transport.address),
            rank=rank,
            world_size=world_size,
            lighthouse_addr=config.lighthouse_url(),
            timeout=timedelta(seconds=config.timeout_s),
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timedelta(seconds=config.connect_timeout_s),
            world_size_mode=WorldSizeMode.DYNAMIC,
            checkpoint_transport=self.transport,
            init_sync=True,
            quorum_retries=config.quorum_retries,
        )
        self._client = _QuorumClient(self._manager._client)
        self._manager._client = self._client
        # The full id (torchft appended a uuid) that this group's heal server answers with.
        self.replica_id = self._manager._store.get(REPLICA_ID_KEY).decode()
        self.transport.replica_id = self.replica_id
        # As torchft's Manager registers it (given no store_addr): answered with the proof.
        self.transport.store_address = f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT'])}"

    # -- per step ----------------------------------------------------------------------------

    def start_step(self) -> QuorumInfo:
        """Join this step's quorum; heals this group first when it is behind (sync quorum)."""
        self._healed_now = False
        start = time.perf_counter()
        try:
            self._manager.start_quorum()
        except TimeoutError as e:
            raise QuorumTimeout(
                f"[group {self.group} rank {self.rank}] no quorum from the lighthouse "
                f"{self.config.lighthouse_url()} within replica.quorum_timeout_s={self.config.quorum_timeout_s}: "
                "is it running and reachable?"
            ) from e
        quorum = self._client.last_quorum
        self._check_members(sorted(quorum.replica_ids) if quorum is not None else [])
        if quorum is not None:
            self._check_store(str(quorum.store_address))
        self._check_configured()
        prank = self._manager.participating_rank()
        npart = self._manager.num_participants()
        return QuorumInfo(
            step=self._manager.current_step(),
            # Sync mode: every group in the quorum participates (None only under async/spares).
            participating_rank=int(prank if prank is not None else 0),
            num_participants=int(npart),
            quorum_id=self._client.lighthouse_quorum_id,
            members=sorted(quorum.replica_ids) if quorum is not None else [],
            healed=self._healed_now,
            heal_bytes=self.transport.last_recv_bytes if self._healed_now else 0,
            heal_s=self.transport.last_recv_s if self._healed_now else 0.0,
            quorum_s=time.perf_counter() - start,
            unproven={**self._unproven, **self._store_refused},
        )

    def _check_members(self, members: list[str]) -> None:
        """After a quorum with other members than the last: rank 0 asks each to prove it holds the
        job secret (``quorum_auth``) and the group agrees on the outcome. While one cannot, this
        group's step fails here: nothing crosses groups, and its vote is not to commit."""
        if members != self._checked or self._unproven:  # a member that failed is asked again
            self._checked = members
            check = functools.partial(self._prove_members, members)
            outcome = rdist.agree(check, src=0, what="quorum members' proof of the job secret")
            self._unproven, self._stores = outcome["unproven"], outcome["stores"]
            for member, reason in self._unproven.items():
                log.error(
                    "[group %d rank %d] quorum member %s cannot prove it belongs to this job (%s): not committing "
                    "alongside it",
                    self.group,
                    self.rank,
                    member,
                    reason,
                    extra={"event": "quorum_unproven", "member": member, "reason": reason},
                )
        if self._unproven and self._manager.errored() is None:  # an earlier error names the cause
            self._manager.report_error(
                QuorumError(f"quorum member(s) {sorted(self._unproven)} cannot prove they hold the job secret")
            )

    def _check_configured(self) -> None:
        """torchft records a quorum's id BEFORE it builds that quorum's process group, so a build
        that failed is never retried while the quorum stays the same: every later step would fail
        its vote, forever. A restart gives this group new member ids, hence a new quorum that every
        group rebuilds for; torchrun restarts the group when this raises. Decided by the whole group
        (one tiny all-reduce): every rank raises, or none, before any step collective."""
        pg = self._manager._pg
        if not hasattr(pg, "_pg"):
            raise ResilientError(f"torchft's {type(pg).__name__} has no _pg: this torchft is not 0.2.0 (pinned)")
        built = torch.tensor([0 if pg._pg is None else 1], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(built, op=dist.ReduceOp.MIN)
        if int(built) == 1:
            return
        error = self._manager.errored()
        cause = error.original_exception if error is not None else None
        where = "this rank's" if pg._pg is None else "a peer rank's"
        raise QuorumError(
            f"[group {self.group} rank {self.rank}] {where} cross-group process group of quorum "
            f"{self._client.lighthouse_quorum_id} could not be built ({cause or 'see that rank'}); "
            "restarting this group so that the quorum changes"
        ) from cause

    def _prove_members(self, members: list[str]) -> dict[str, Any]:
        """Rank 0: the members that cannot prove themselves, and the stores the others registered."""
        unproven = self._members.unproven(members, self.replica_id)
        return {"unproven": unproven, "stores": [*self._members.stores(members), self.transport.store_address]}

    def _check_store(self, store_address: str) -> None:
        """Refuse a quorum whose store (where this rank's cross-group rendezvous meets) no proven
        member registered: a stranger re-registered under a real member's id with its own store.
        This rank's own outcome (each rank of a group may meet at another member's store); every
        group's same rank meets at the same store, so each refuses in every real group."""
        self._store_refused = {}
        if store_address in self._stores:
            return
        reason = f"the quorum's store {store_address} is no proven member's: a member's id was taken over"
        # Kept apart from the agreed ``_unproven``: the group's ranks decide together when to prove
        # members again, and this outcome is this rank's alone.
        self._store_refused = {f"store {store_address}": reason}
        log.error(
            "[group %d rank %d] %s: not committing alongside it",
            self.group,
            self.rank,
            reason,
            extra={"event": "quorum_unproven", "member": f"store {store_address}", "reason": reason},
        )
        if self._manager.errored() is None:
            self._manager.report_error(QuorumError(reason))

    def allreduce_sum(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` (in place) over the participating groups' same-rank peers.

        torchft's default averages; the trainer's loss is normalized by the GLOBAL token count so
        that gradients must be SUMMED over every data-parallel rank (dp_shard x groups). After the
        first failure in a step every later call is a no-op: the step is discarded by should_commit.
        """
        if self._unproven or self._store_refused:  # a stranger is in the quorum: it gets none of our values
            return False
        return bool(self._manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait())

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Sum every parameter's local gradient shard across groups: one flat all-reduce per dtype."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        ok = True
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            ok &= self.allreduce_sum(flat)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        return ok

    def should_commit(self) -> bool:
        """True when every rank of this group finished the step without a cross-group error and
        enough groups participated; the step counter advances only then."""
        return bool(self._manager.should_commit())

    # -- restore -----------------------------------------------------------------------------

    def restore_step(self, step: int, batches_committed: int = 0) -> None:
        """Tell the Manager where a storage restore left this group, BEFORE the first quorum:
        otherwise it reports step 0 and is healed over (or, all groups restarted, counts from 0)."""
        self._manager.load_state_dict({"step": step, "batches_committed": batches_committed})

    def current_step(self) -> int:
        return int(self._manager.current_step())

    def _on_heal(self, state: dict[str, Any]) -> None:
        if has_shards(state):  # DTensors arrive as local shards: put them on this rank's own mesh
            state = adopt_shards(state, self._user_state())
        self._load_user_state(state)
        self._healed_now = True

    def shutdown(self) -> None:
        self._manager.shutdown(wait=False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
