"""The RAM tier's one collective restore decision: own snapshot, else the buddy's copy.

Collective over the group and decided before anything is loaded: every rank reports the snapshots
it can supply (its own, and the copies it keeps for its buddies), every rank computes the same
choice — the newest step every rank can get from RAM, if it is at least the newest persistent
step — then each rank fetches and verifies its part (own store, else its buddy's copy). If any rank
cannot, that step is excluded for all and the decision is taken again; the caller falls back to
storage when no RAM step is left. Only snapshots of the current run and timeline (the tier's
``timeline``, see ``ram.timeline``) taken on the same topology (world size, ranks per node, mesh,
tensor layout) are candidates; the others are listed in ``excluded`` with the reason.

A snapshot belongs to the rank it was taken on (the rank is its place in the mesh, so its shard),
not to a machine: after a restart that renumbered the ranks (elastic rendezvous), rank r restores
rank r's snapshot wherever it now lies — a store of its own node (read in place, source "own"),
else any rank that offers it (its buddy first; source "buddy"). Restoring the snapshot a machine
took into the rank that machine now runs would put another rank's shard there.

When a persistent step backs the decision, each rank puts its snapshot straight into the training
tensors while checking it: an own snapshot is copied in, a buddy's copy received into them
(``ram.inplace``; whatever lands there is overwritten if the step is not restored after all). With
none, a snapshot is checked where it lies (or in fresh memory) and copied only after every rank
agreed, so a rank never holds the step while its peers keep the initial state.

Each exchange goes through ``dist.agree``. A store that cannot be read or a copy that cannot be
fetched is a vote (this rank reports nothing, or votes against the step), so no rank raises alone
while its peers wait in the next collective; anything else (a bug) is raised on every rank.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from resilient import dist as rdist
from resilient.recovery.ram.buddy import snapshot_key
from resilient.recovery.ram.channel import ChannelError
from resilient.recovery.ram.inplace import TensorLanding, copy_verified, tensor_targets
from resilient.recovery.ram.store import SnapshotIndex, first_corruption, layout_tensors, local_tensors, tensor_view
from resilient.recovery.ram.wire import Scatter
from resilient.state import Leaf, flatten_state, set_leaf

if TYPE_CHECKING:
    from resilient.recovery.ram.tier import RamTier

log = logging.getLogger(__name__)

Fetched = tuple[str, SnapshotIndex, torch.Tensor | None]
"""(source, index, data) of a verified snapshot; data None when it was received into the tensors."""

Report = dict[str, Any]
"""One rank's offer: ``{"own": [steps], "kept": {"<rank>": [steps]}}`` (JSON: rank keys are strings).
"kept" holds the copies it keeps for its buddies and, on a node's first rank, the snapshots other
ranks left on this node under an earlier rank numbering (``RamTier.left_here``)."""


@dataclass(slots=True)
class RamRestore:
    """The outcome of one restore decision on this rank."""

    step: int | None
    source: str | None  # "own" (this node's RAM) | "buddy" (another node's) | None (storage or fresh)
    bytes: int = 0
    seconds: float = 0.0
    excluded: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    """Every rank's source of the restored step ("own" or "buddy"), indexed by rank: a rank whose own
    snapshot is gone or damaged fetched its buddy's copy, so a group's ranks may differ."""
    snapshot_timeline: str = ""
    """The timeline the snapshot this rank restored was taken on (the current one or an ancestor)."""


def restore_from_ram(
    tier: RamTier, state: dict[str, Any], persistent_step: int | None, *, newest: int | None = None
) -> RamRestore:
    """Collective: restore ``state`` in place from the newest step every rank has in RAM, if it is
    not older than ``persistent_step`` nor newer than ``newest`` (``checkpoint.load_step``).
    Returns what was decided (source None: not from RAM). With ``persistent_step`` given and source
    None, ``state``'s tensors are undefined (a snapshot may have landed in part): the caller must
    load a committed step into it, or fail."""
    start = time.perf_counter()
    # Receiving in place is safe only if a step that is not restored after all is overwritten by
    # the persistent load the caller falls back to (see ``ram.inplace``).
    decision = _Decision(tier, flatten_state(state), newest, in_place=persistent_step is not None)
    reports: list[Report] = rdist.agree(decision.report, what="RAM restore")
    ruled_out: set[int] = set()
    while True:
        step = choose_step(reports, ruled_out)
        if step is None or (persistent_step is not None and step < persistent_step):
            return RamRestore(None, None, excluded=decision.excluded, seconds=time.perf_counter() - start)
        verdicts = rdist.agree(functools.partial(decision.fetch, step, reports), what=f"RAM restore of step {step}")
        if all(verdicts):
            rdist.agree(functools.partial(decision.apply, step), what=f"RAM restore of step {step}")
            assert decision.fetched is not None
            source, index, _ = decision.fetched
            seconds = time.perf_counter() - start
            restored = RamRestore(step, source, index.nbytes, seconds, decision.excluded, sources=list(verdicts))
            restored.snapshot_timeline = index.timeline
            return restored
        failed = [r for r, ok in enumerate(verdicts) if not ok]
        log.warning("[rank %d] RAM step %d unusable on rank(s) %s: excluded", tier.rank, step, failed)
        ruled_out.add(step)


def choose_step(reports: list[Report], ruled_out: set[int]) -> int | None:
    """The newest step every rank can get from its own store or from any rank that offers a copy
    (its buddy, or a node it ran on under an earlier numbering); the same on every rank."""
    common: set[int] | None = None
    for rank, report in enumerate(reports):
        available = set(report["own"])
        for holder in reports:
            available |= set(holder["kept"].get(str(rank), []))
        common = available if common is None else common & available
    candidates = (common or set()) - ruled_out
    return max(candidates) if candidates else None


class _Decision:
    """This rank's side of one decision: what it offers, what it fetched, what it excluded and why."""

    def __init__(
        self, tier: RamTier, leaves: dict[str, Leaf], newest: int | None = None, *, in_place: bool = False
    ) -> None:
        self.tier, self.leaves, self.newest, self.in_place = tier, leaves, newest, in_place
        self.excluded: list[dict[str, Any]] = []
        self.fetched: Fetched | None = None
        """(source, index, data): data None when the snapshot was received into the tensors themselves."""

    def _exclude(self, step: int | None, source: str, reason: str) -> None:
        self.excluded.append({"step": step, "source": source, "reason": reason})

    # -- report ------------------------------------------------------------------------------

    def report(self) -> Report:
        """The steps this rank can supply; whatever goes wrong reading its store, it offers nothing."""
        try:
            return self._report()
        except Exception as e:
            self._exclude(None, "own", f"store unreadable: {type(e).__name__}: {e}")
            return {"own": [], "kept": {}}

    def _report(self) -> Report:
        tier = self.tier
        own = []
        indexes = tier.own.indexes()
        for reason in tier.own.unreadable:
            self._exclude(None, "own", reason)
        for step, index in sorted(indexes.items()):
            reason = self.incompatible(index)
            if reason is None:
                own.append(step)
            else:
                self._exclude(step, "own", reason)
        ranks = sorted({*tier.pairing.kept_by(tier.rank), *tier.left_here()})
        kept = {str(r): self._kept(r) for r in ranks}
        return {"own": own, "kept": kept}

    def _kept(self, rank: int) -> list[int]:
        """The steps of ``rank``'s snapshots on this node this rank may offer (their layout is
        checked by ``rank``)."""
        offered = set()
        for store in self.tier.copies_of(rank):
            for step, index in sorted(store.indexes().items()):
                reason = self.ineligible(index) or self._not_of(index, rank)
                if reason is None:
                    offered.add(step)
                else:
                    self._exclude(step, "buddy", f"copy kept for rank {rank}: {reason}")
        return sorted(offered)

    def unfit(self, index: SnapshotIndex) -> str | None:
        """Why a snapshot found outside this rank's own store may not go into its state: another
        rank's, or incompatible (None: it may, once its bytes verify)."""
        return self._not_of(index, self.tier.rank) or self.incompatible(index)

    @staticmethod
    def _not_of(index: SnapshotIndex, rank: int) -> str | None:
        return None if index.rank == rank else f"taken on rank {index.rank}, not {rank}"

    def ineligible(self, index: SnapshotIndex) -> str | None:
        """Why ``index`` may not restore now whatever its contents: another run or timeline, or a
        step after the one asked for (None: it may)."""
        reason = self.tier.timeline.why_not(index.run_id, index.timeline, index.step)
        if reason is None and self.newest is not None and index.step > self.newest:
            reason = f"newer than the step asked for (checkpoint.load_step={self.newest})"
        return reason

    def incompatible(self, index: SnapshotIndex) -> str | None:
        """Why ``index`` cannot go into this training state (None: it can)."""
        reason = self.ineligible(index)
        if reason is not None:
            return reason
        if index.topology != self.tier.topology:
            return f"taken on another topology {index.topology} (now {self.tier.topology})"
        layout = {e.fqn: (e.dtype, e.shape) for e in index.tensors}
        current = {e.fqn: (e.dtype, e.shape) for e in layout_tensors(local_tensors(self.leaves))[0]}
        if layout != current:
            differ = sorted(set(layout.items()) ^ set(current.items()), key=str)[:3]
            return f"tensor layout differs from the training state (e.g. {differ})"
        if set(index.values) != {fqn for fqn, leaf in self.leaves.items() if not leaf.is_tensor}:
            return "JSON values differ from the training state"
        return None

    # -- fetch -------------------------------------------------------------------------------

    def fetch(self, step: int, reports: list[Report]) -> str | None:
        """This rank's vote on ``step``: where its verified snapshot came from ("own" or "buddy"),
        or None when it has none."""
        self.fetched = None
        try:
            self.fetched = self._fetch(step, reports)
        except Exception as e:
            self._exclude(step, "own", f"{type(e).__name__}: {e}")
        return None if self.fetched is None else self.fetched[0]

    def _fetch(self, step: int, reports: list[Report]) -> Fetched | None:
        rank = self.tier.rank
        if step in reports[rank]["own"]:
            own = self._own_verified(step)
            if not isinstance(own, str):
                return own
            self._exclude(step, "own", own)
            log.warning("[rank %d] own RAM snapshot of step %d unusable: %s", rank, step, own)
        here = self._here(step)
        if here is not None:
            return here
        holders = [h for h, report in enumerate(reports) if step in report["kept"].get(str(rank), [])]
        buddy = self.tier.pairing.buddy_of(rank)
        for holder in sorted(holders, key=lambda h: h != buddy):  # the buddy first, then the rest
            if holder not in self.tier.pairing.ranks_on(self.tier.node):
                fetched = self._fetch_from_buddy(step, holder)
                if fetched is not None:
                    return fetched
        return None

    def _here(self, step: int) -> Fetched | None:
        """This rank's snapshot of ``step`` from another store of this node (left here when the
        ranks were renumbered): read in place, no network."""
        for store in self.tier.copies_of(self.tier.rank):
            try:
                index = store.indexes().get(step)
                if index is None:
                    continue
                fetched = self._verified("own", index, store.data(index))
            except Exception as e:  # a missing slot file, an I/O error: another copy may still do
                fetched = f"{type(e).__name__}: {e}"
            if not isinstance(fetched, str):
                return fetched
            self._exclude(step, "own", f"{store.directory}: {fetched}")
        return None

    def _own_verified(self, step: int) -> Fetched | str:
        """This rank's own snapshot of ``step`` if it verifies, else why not."""
        try:
            index = self.tier.own.indexes().get(step)
            if index is None:
                return "gone from the store"
            return self._verified("own", index, self.tier.own.data(index), own=True)
        except Exception as e:  # a missing slot file, an I/O error: the buddy's copy may still do
            return f"{type(e).__name__}: {e}"

    def _verified(self, source: str, index: SnapshotIndex, data: torch.Tensor, *, own: bool = False) -> Fetched | str:
        """``index``'s snapshot in ``data`` if it verifies (and, found outside this rank's own
        store, is this rank's and fits the state), else why not. In place (``ram.inplace``), it is
        copied into the training tensors as it is checked."""
        reason = None if own else self.unfit(index)
        if reason is not None:
            return reason
        targets = tensor_targets(index, local_tensors(self.leaves)) if self.in_place else None
        if targets is None:
            return first_corruption(index, data) or (source, index, data)
        return copy_verified(index, data, targets) or (source, index, None)

    def _fetch_from_buddy(self, step: int, holder: int) -> Fetched | None:
        into = _IntoTensors(self)
        try:
            with self.tier.connect_to(holder) as client:
                reply = client.get(snapshot_key(self.tier.rank, step), into=into)
        except ChannelError as e:
            self._exclude(step, "buddy", f"fetch from rank {holder} failed: {e}")
            return None
        if reply is None:
            self._exclude(step, "buddy", f"rank {holder} no longer has it")
            return None
        header, payload = reply
        if into.landing is not None:  # received into the training tensors, checksummed as it landed
            fetched: Fetched | str = into.landing.corruption() or ("buddy", into.landing.index, None)
        else:
            # The client hands over the memory it received into (wire.fresh_buffer): no further
            # copy; the tensor keeps that memory alive.
            data = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
            fetched = self._verified("buddy", SnapshotIndex.from_json(header["index"]), data)
        if isinstance(fetched, str):
            self._exclude(step, "buddy", fetched)
            return None
        return fetched

    # -- apply -------------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, step: int) -> None:
        """Copy the fetched snapshot of ``step`` into the training state, then hide the abandoned timeline."""
        assert self.fetched is not None
        _, index, data = self.fetched
        if data is not None:  # None: received into the tensors already
            tensors = local_tensors(self.leaves)
            for entry in index.tensors:
                tensors[entry.fqn].copy_(tensor_view(data, entry))
        for fqn, value in index.values.items():
            set_leaf(self.leaves[fqn], value)
        # Snapshots after the restored step belong to the abandoned timeline: hidden, so a later
        # decision can never mix them with snapshots of the new one.
        self.tier.own.remove_newer(step)
        for rank in {*self.tier.pairing.kept_by(self.tier.rank), *self.tier.left_here(), self.tier.rank}:
            for store in self.tier.copies_of(rank):
                store.remove_newer(step)


class _IntoTensors:
    """``ReplicationClient.get``'s ``into`` for one fetch: the training tensors when they may take
    the buddy's copy (``in_place``, the copy is this rank's and fits the state), else fresh memory
    (None); ``landing`` says which it was once the header arrived."""

    def __init__(self, decision: _Decision) -> None:
        self.decision = decision
        self.landing: TensorLanding | None = None

    def __call__(self, header: dict, nbytes: int) -> Scatter | None:
        decision = self.decision
        if not decision.in_place:
            return None
        try:
            index = SnapshotIndex.from_json(header["index"])
        except Exception:  # a malformed index is excluded after the receive, with its reason
            return None
        if nbytes != index.nbytes or decision.unfit(index):
            return None
        targets = tensor_targets(index, local_tensors(decision.leaves))
        if targets is None:
            return None
        try:
            self.landing = TensorLanding(index, targets)
        except ValueError:  # overlapping offsets (never from layout_tensors): checked the old way
            return None
        return self.landing.scatter()
