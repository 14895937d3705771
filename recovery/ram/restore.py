"""The RAM tier's one collective restore decision: own snapshot, else the buddy's copy.

Collective over the group and decided before anything is loaded: every rank reports the snapshots
it can supply (its own, and the copies it keeps for its buddies), every rank computes the same
choice — the newest step every rank can get from RAM, if it is at least the newest persistent
step — then each rank fetches and verifies its part (own store, else its buddy's copy). If any rank
cannot, that step is excluded for all and the decision is taken again; the caller falls back to
storage when no RAM step is left. Only snapshots of the current run and timeline (the tier's
``timeline``, see ``recovery.timeline``) taken on the same topology (world size, ranks per node, mesh,
tensor layout) are candidates; the others are listed in ``excluded`` with the reason.

A snapshot belongs to the rank it was taken on (the rank is its place in the mesh, so its shard),
not to a machine: after a restart that renumbered the ranks (elastic rendezvous), rank r restores
rank r's snapshot wherever it now lies — a store of its own node (read in place, source "own"),
else any rank that offers it (its buddy first; source "buddy"). Restoring the snapshot a machine
took into the rank that machine now runs would put another rank's shard there.

When the caller allows it (``in_place``: a persistent step backs the decision, or the caller can
put the initial state back), each rank puts its snapshot straight into the training tensors while
checking it: an own snapshot is copied in, a buddy's copy received into them (``ram.inplace``).
Whatever lands there of a step that is not restored after all is then the caller's to overwrite
(``RamRestore.touched``): by the persistent load, or by putting the initial state back. Otherwise
an own snapshot is checked where it lies and a buddy's copy received into fresh memory,
checksummed as it lands, and either is copied only after every rank agreed, so a rank never holds
the step while its peers keep the initial state (the fresh start left if a peer's fetch fails
trains the state's tensors as they are: they are the model's and the optimizer's). That order
costs the fetching rank a fresh mapping and a copy more (benchmarks/README.md, "The buddy restore
without a persistent step, in place").

Each exchange goes through ``dist.agree``. A store that cannot be read or a copy that cannot be
fetched is a vote (this rank reports nothing, or votes against the step), so no rank raises alone
while its peers wait in the next collective; anything else (a bug) is raised on every rank.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from resilient import dist as rdist
from resilient.recovery.channel import ChannelError, Scatter, fresh_buffer
from resilient.recovery.ram.buddy import snapshot_key
from resilient.recovery.ram.inplace import TensorLanding, copy_verified, tensor_targets
from resilient.recovery.ram.view import RamView
from resilient.recovery.snapshot_format import (
    CrcAsItLands,
    SnapshotIndex,
    first_corruption,
    layout_tensors,
    local_tensors,
    tensor_view,
)
from resilient.state import Leaf, flatten_state, set_leaf

log = logging.getLogger(__name__)


class Fetched(NamedTuple):
    """A verified snapshot of this rank."""

    source: str  # "own" | "buddy"
    index: SnapshotIndex
    data: torch.Tensor | None  # None: it was received into the training tensors already


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one look at a snapshot gave: the verified snapshot, or why there is none."""

    fetched: Fetched | None = None
    reason: str | None = None

    @classmethod
    def checked(cls, reason: str | None, fetched: Fetched) -> Verdict:
        """``fetched`` if its check found nothing wrong (``reason`` None), else ``reason``."""
        return cls(reason=reason) if reason else cls(fetched=fetched)


Report = dict[str, Any]
"""One rank's offer: ``{"own": [steps], "kept": {"<rank>": [steps]}}`` (JSON: rank keys are strings).
"kept" holds the copies it keeps for its buddies and, on a node's first rank, the snapshots other
ranks left on this node under an earlier rank numbering (``RamView.left_here``)."""


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
    touched: bool = False
    """Whether this rank began writing a snapshot into ``state``'s tensors (``in_place``, and they
    could take it: host memory, dense); ranks may differ. With source None they then hold bytes of
    a step that was not restored: the caller must load a step into them, put the initial state
    back, or fail."""


def restore_from_ram(
    view: RamView,
    state: dict[str, Any],
    persistent_step: int | None,
    *,
    newest: int | None = None,
    in_place: bool = False,
) -> RamRestore:
    """Collective: restore ``state`` in place from the newest step every rank has in RAM, if it is
    not older than ``persistent_step`` nor newer than ``newest`` (``checkpoint.load_step``).
    Returns what was decided (source None: not from RAM). ``in_place``: each snapshot may land in
    ``state``'s tensors as it is checked (``ram.inplace``), because the caller overwrites them if
    no step is restored after all (``RamRestore.touched``); otherwise a rank's state keeps what it
    holds until every rank has its snapshot."""
    start = time.perf_counter()
    decision = _Decision(view, flatten_state(state), newest, in_place=in_place)
    reports: list[Report] = rdist.agree(decision.report, what="RAM restore")
    ruled_out: set[int] = set()
    while True:
        step = choose_step(reports, ruled_out)
        if step is None or (persistent_step is not None and step < persistent_step):
            seconds = time.perf_counter() - start
            return RamRestore(None, None, excluded=decision.excluded, seconds=seconds, touched=decision.touched)
        votes = rdist.agree(functools.partial(decision.fetch, step, reports), what=f"RAM restore of step {step}")
        if all(votes):
            rdist.agree(functools.partial(decision.apply, step), what=f"RAM restore of step {step}")
            assert decision.fetched is not None
            source, index, _ = decision.fetched
            seconds = time.perf_counter() - start
            restored = RamRestore(step, source, index.nbytes, seconds, decision.excluded, sources=list(votes))
            restored.snapshot_timeline, restored.touched = index.timeline, decision.touched
            return restored
        failed = [r for r, ok in enumerate(votes) if not ok]
        log.warning("[rank %d] RAM step %d unusable on rank(s) %s: excluded", view.rank, step, failed)
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
    """This rank's side of one decision: what it offers, what it fetched, what it excluded and why.
    It reads the tier only through ``view``."""

    def __init__(
        self, view: RamView, leaves: dict[str, Leaf], newest: int | None = None, *, in_place: bool = False
    ) -> None:
        self.view, self.leaves, self.newest, self.in_place = view, leaves, newest, in_place
        self.excluded: list[dict[str, Any]] = []
        self.fetched: Fetched | None = None
        self.touched = False
        """Whether a snapshot began landing in the training tensors (``RamRestore.touched``)."""

    def _exclude(self, step: int | None, source: str, reason: str) -> None:
        self.excluded.append({"step": step, "source": source, "reason": reason})

    def why_not(self, index: SnapshotIndex, *, rank: int | None = None, fits: bool = True) -> str | None:
        """Why ``index`` may not restore (None: it may, once its bytes verify): taken on another
        rank than ``rank`` (when given: found outside that rank's own store); of another run or
        timeline, or after the step asked for; and, with ``fits``, taken on another topology or
        with another tensor layout or other JSON values than this training state (a copy kept for
        another rank is fitted by that rank: ``fits=False``)."""
        if rank is not None and index.rank != rank:
            return f"taken on rank {index.rank}, not {rank}"
        reason = self.view.timeline.why_not(index.run_id, index.timeline, index.step)
        if reason is None and self.newest is not None and index.step > self.newest:
            reason = f"newer than the step asked for (checkpoint.load_step={self.newest})"
        if reason is not None or not fits:
            return reason
        if index.topology != self.view.topology:
            return f"taken on another topology {index.topology} (now {self.view.topology})"
        layout = {e.fqn: (e.dtype, e.shape) for e in index.tensors}
        current = {e.fqn: (e.dtype, e.shape) for e in layout_tensors(local_tensors(self.leaves))[0]}
        if layout != current:
            differ = sorted(set(layout.items()) ^ set(current.items()), key=str)[:3]
            return f"tensor layout differs from the training state (e.g. {differ})"
        if set(index.values) != {fqn for fqn, leaf in self.leaves.items() if not leaf.is_tensor}:
            return "JSON values differ from the training state"
        return None

    # -- report ------------------------------------------------------------------------------

    def report(self) -> Report:
        """The steps this rank can supply; whatever goes wrong reading its store, it offers nothing."""
        try:
            return self._report()
        except Exception as e:
            self._exclude(None, "own", f"store unreadable: {type(e).__name__}: {e}")
            return {"own": [], "kept": {}}

    def _report(self) -> Report:
        view = self.view
        own = []
        indexes = view.own.indexes()
        for reason in view.own.unreadable:
            self._exclude(None, "own", reason)
        for step, index in sorted(indexes.items()):
            reason = self.why_not(index)
            if reason is None:
                own.append(step)
            else:
                self._exclude(step, "own", reason)
        ranks = sorted({*view.pairing.kept_by(view.rank), *view.left_here()})
        kept = {str(r): self._kept(r) for r in ranks}
        return {"own": own, "kept": kept}

    def _kept(self, rank: int) -> list[int]:
        """The steps of ``rank``'s snapshots on this node this rank may offer (their layout is
        checked by ``rank``)."""
        offered = set()
        for store in self.view.copies_of(rank):
            for step, index in sorted(store.indexes().items()):
                reason = self.why_not(index, rank=rank, fits=False)
                if reason is None:
                    offered.add(step)
                else:
                    self._exclude(step, "buddy", f"copy kept for rank {rank}: {reason}")
        return sorted(offered)

    # -- fetch -------------------------------------------------------------------------------

    def fetch(self, step: int, reports: list[Report]) -> str | None:
        """This rank's vote on ``step``: where its verified snapshot came from ("own" or "buddy"),
        or None when it has none."""
        self.fetched = None
        try:
            self.fetched = self._fetch(step, reports)
        except Exception as e:
            self._exclude(step, "own", f"{type(e).__name__}: {e}")
        return None if self.fetched is None else self.fetched.source

    def _fetch(self, step: int, reports: list[Report]) -> Fetched | None:
        rank = self.view.rank
        if step in reports[rank]["own"]:
            own = self._own_verified(step)
            if own.fetched is not None:
                return own.fetched
            self._exclude(step, "own", own.reason)
            log.warning("[rank %d] own RAM snapshot of step %d unusable: %s", rank, step, own.reason)
        here = self._here(step)
        if here is not None:
            return here
        holders = [h for h, report in enumerate(reports) if step in report["kept"].get(str(rank), [])]
        buddy = self.view.pairing.buddy_of(rank)
        for holder in sorted(holders, key=lambda h: h != buddy):  # the buddy first, then the rest
            if holder not in self.view.node_ranks:
                fetched = self._fetch_from_buddy(step, holder)
                if fetched is not None:
                    return fetched
        return None

    def _here(self, step: int) -> Fetched | None:
        """This rank's snapshot of ``step`` from another store of this node (left here when the
        ranks were renumbered): read in place, no network."""
        for store in self.view.copies_of(self.view.rank):
            try:
                index = store.indexes().get(step)
                if index is None:
                    continue
                verdict = self._verified("own", index, store.data(index))
            except Exception as e:  # a missing slot file, an I/O error: another copy may still do
                verdict = Verdict(reason=f"{type(e).__name__}: {e}")
            if verdict.fetched is not None:
                return verdict.fetched
            self._exclude(step, "own", f"{store.directory}: {verdict.reason}")
        return None

    def _own_verified(self, step: int) -> Verdict:
        """This rank's own snapshot of ``step``, if it verifies."""
        try:
            index = self.view.own.indexes().get(step)
            if index is None:
                return Verdict(reason="gone from the store")
            return self._verified("own", index, self.view.own.data(index), own=True)
        except Exception as e:  # a missing slot file, an I/O error: the buddy's copy may still do
            return Verdict(reason=f"{type(e).__name__}: {e}")

    def _verified(self, source: str, index: SnapshotIndex, data: torch.Tensor, *, own: bool = False) -> Verdict:
        """``index``'s snapshot in ``data`` if it verifies (and, found outside this rank's own
        store, is this rank's and fits the state). In place (``ram.inplace``), it is copied into the
        training tensors as it is checked."""
        reason = None if own else self.why_not(index, rank=self.view.rank)
        if reason is not None:
            return Verdict(reason=reason)
        targets = tensor_targets(index, local_tensors(self.leaves)) if self.in_place else None
        if targets is None:
            return Verdict.checked(first_corruption(index, data), Fetched(source, index, data))
        self.touched = True
        return Verdict.checked(copy_verified(index, data, targets), Fetched(source, index, None))

    def _fetch_from_buddy(self, step: int, holder: int) -> Fetched | None:
        into = _IntoTensors(self)
        try:
            with self.view.connect(holder) as client:
                reply = client.get(snapshot_key(self.view.rank, step), into=into)
        except ChannelError as e:
            self._exclude(step, "buddy", f"fetch from rank {holder} failed: {e}")
            return None
        if reply is None:
            self._exclude(step, "buddy", f"rank {holder} no longer has it")
            return None
        header, payload = reply
        if into.crc is not None:  # checksummed as it landed: in the training tensors, or in fresh memory
            verdict = Verdict.checked(into.crc.corruption(), Fetched("buddy", into.crc.index, into.data))
        else:
            # The client hands over the memory it received into (wire.fresh_buffer): no further
            # copy; the tensor keeps that memory alive.
            data = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
            verdict = self._verified("buddy", SnapshotIndex.from_json(header["index"]), data)
        if verdict.fetched is None:
            self._exclude(step, "buddy", verdict.reason)
        return verdict.fetched

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
        view = self.view
        view.own.remove_newer(step)
        for rank in {*view.pairing.kept_by(view.rank), *view.left_here(), view.rank}:
            for store in view.copies_of(rank):
                store.remove_newer(step)


class _IntoTensors:
    """``ReplicationClient.get``'s ``into`` for one fetch of a copy that is this rank's and fits the
    state: the training tensors when they may take it (``in_place``), else fresh memory that the
    decision copies from once every rank agreed (``data``). Either way each tensor's crc32c is
    taken as its pieces land (``crc``), not in a pass of its own. Anything else (a malformed or
    foreign index, overlapping tensors) is left to the client's fresh memory and checked after
    the receive, with its reason."""

    def __init__(self, decision: _Decision) -> None:
        self.decision = decision
        self.crc: CrcAsItLands | None = None
        self.data: torch.Tensor | None = None  # the fresh memory it landed in; None: the training tensors

    def __call__(self, header: dict, nbytes: int) -> Scatter | None:
        decision = self.decision
        try:
            index = SnapshotIndex.from_json(header["index"])
        except Exception:  # a malformed index is excluded after the receive, with its reason
            return None
        if nbytes != index.nbytes or decision.why_not(index, rank=decision.view.rank):
            return None
        targets = tensor_targets(index, local_tensors(decision.leaves)) if decision.in_place else None
        try:
            if targets is not None:
                landing = TensorLanding(index, targets)
                self.crc, decision.touched = landing.crc, True
                return landing.scatter()
            crc = CrcAsItLands(index)
        except ValueError:  # overlapping offsets (never from layout_tensors): checked the old way
            return None
        # Not in place: the state keeps what it holds until every rank has agreed on the step.
        buffer = fresh_buffer(nbytes)
        self.crc = crc
        self.data = torch.frombuffer(buffer, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return Scatter([memoryview(buffer)], lambda _, piece: crc(piece))
