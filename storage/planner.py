"""What every rank agrees before a save stages anything: the decision (DESIGN §6).

One ``dist.agree`` carries each rank's tensor layout (only when it changed since the last save),
its JSON leaves, its busy flag and any background error not yet raised; every rank then computes
the same plan from the same gathered layouts, or raises the same error, or skips together.
``SavePlanner`` holds what that needs between saves (the layouts last sent and received, the plan
they give) and returns one explicit ``SaveDecision``; the Checkpointer stages and submits it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilient import dist
from resilient.errors import CommitError, ConfigError, StateError
from resilient.layout import ArrayPlan, LocalTensor, plan_arrays
from resilient.manifest import MANIFEST, step_dir
from resilient.state import flatten_state
from resilient.storage.config import CheckpointerConfig
from resilient.storage.describe import LayoutCache
from resilient.storage.objects import ObjectStore
from resilient.storage.outcomes import SaveOutcomes
from resilient.storage.retention import new_attempt
from resilient.storage.snapshot import Snapshot, SnapshotLayout, snapshot_layout

Early = tuple[SnapshotLayout, Snapshot]


@dataclass(slots=True)
class SaveDecision:
    """The agreed save: every rank holds the same ``attempt`` and ``plans``."""

    step: int
    attempt: str | None
    """None: some rank was busy under ``if_busy="skip"``, so every rank skips."""
    plans: dict[str, ArrayPlan] | None = None
    layout: SnapshotLayout | None = None
    """Where this rank stages its part of ``plans``."""
    values: list[dict] = field(default_factory=list)
    """Every rank's JSON leaves (the coordinator writes them into the manifest)."""
    locals: dict[str, LocalTensor] = field(default_factory=dict)
    """This rank's tensors, described."""
    early: Early | None = None
    """A copy taken by the previous plan while the agreement crossed, if that plan still holds."""


class SavePlanner:
    """The save's agreement and plan, with the state they carry from one save to the next."""

    def __init__(
        self,
        *,
        group: Any,
        rank: int,
        world_size: int,
        store: ObjectStore,
        config: CheckpointerConfig,
        outcomes: SaveOutcomes,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.store, self.config, self.outcomes = store, config, outcomes
        self._layouts = LayoutCache()  # this rank's tensor layouts, described once, not per save
        self._plan_cache: tuple[dict[str, ArrayPlan], SnapshotLayout] | None = None
        self.sent_tensors: list[dict] | None = None  # this rank's layout as last sent to its peers
        self._sent_unchanged = False  # this save's layout is the one last sent
        self._peer_tensors: dict[int, list[dict]] = {}  # every rank's layout as last received
        self._latched_here: BaseException | None = None  # this rank's part of the last agreement

    def decide(
        self,
        step: int,
        state: dict,
        metadata: dict | None,
        *,
        busy: bool,
        late: CommitError | None,
        copy_early: Callable[[SnapshotLayout, dict[str, LocalTensor]], Snapshot],
        discard: Callable[[Early | None], None],
    ) -> SaveDecision:
        """Agree on the save; raises on every rank together. ``copy_early`` stages this rank's part
        by the last plan while the agreement crosses; ``discard`` lets such a copy go when the
        agreement fails or skips."""
        locals_: dict[str, LocalTensor] = {}
        agreement = dist.agree_async(
            lambda: self._describe(step, state, metadata, busy, late, locals_), group=self.group
        )
        early = self._copy_early(agreement, locals_, busy, copy_early)
        try:
            gathered = self._gathered(agreement)
            attempt = None if any(p["busy"] for p in gathered) else gathered[0]["attempt"]
            plans, layout = self._plan() if attempt is not None else (None, None)
        except BaseException:  # every rank raises the same here (the plan is computed alike)
            discard(early)
            raise
        if attempt is None:
            discard(early)
            early = None
        values = [p["values"] for p in gathered] if self.rank == 0 else []
        return SaveDecision(step, attempt, plans, layout, values, locals_, early)

    def _copy_early(
        self, agreement: dist.Agreement, locals_: dict[str, LocalTensor], busy: bool, copy: Callable
    ) -> Early | None:
        """Copy this rank's part while the agreement crosses (its latency, ~5-40 ms among 4 ranks
        on 2 cores, was a third of save()'s stall), by the last plan: valid unless some rank's
        layout changed, which the agreement tells; then it is discarded, as when a rank failed.
        Only under if_busy="wait", where no rank can be busy: under "skip", a peer still busy
        would make a ready rank pay for a copy that is thrown away."""
        if (
            self._plan_cache is None
            or busy
            or self.config.if_busy != "wait"
            or agreement.local_error is not None
            or not self._sent_unchanged
        ):
            return None
        layout = self._plan_cache[1]
        try:
            return layout, copy(layout, locals_)
        except Exception:  # not ours to raise before the agreement: the copy is retried after it
            return None

    def _gathered(self, agreement: dist.Agreement) -> list[dict]:
        """Every rank's part of the agreement, checked alike on every rank."""
        try:
            gathered = agreement.result()
        except Exception:
            self.sent_tensors = None  # every rank resends its layout next time: none was recorded
            raise
        for rank, p in enumerate(gathered):
            if p["tensors"] is not None:
                self._peer_tensors[rank] = p["tensors"]
                self._plan_cache = None
        self.outcomes.settle([p["latched"] for p in gathered], self.rank, self._latched_here)
        if len({p["step"] for p in gathered}) > 1:
            raise ConfigError(
                f"save() called with different steps on different ranks: {[p['step'] for p in gathered]}; "
                "every rank must save the same step"
            )
        return gathered

    def _describe(
        self,
        step: int,
        state: dict,
        metadata: dict | None,
        busy: bool,
        late: CommitError | None,
        locals_: dict[str, LocalTensor],
    ) -> dict:
        """This rank's part of the save decision (fills ``locals_``); rank 0 also checks storage and
        the step and draws the attempt id. A background error not yet raised travels with it
        (``SaveOutcomes``), so that every rank raises it, with its class, and marks it raised."""
        if late is not None:
            raise late
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        values, tensors = {}, {}
        for fqn, leaf in flatten_state(state).items():
            if leaf.is_tensor:
                tensors[fqn] = leaf.value
            else:
                values[fqn] = leaf.value
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise StateError(f"metadata is not JSON-able: {e}") from e
        described_locals, described = self._layouts.describe(tensors)
        locals_.update(described_locals)
        latched, self._latched_here = self.outcomes.pop_first_error()  # last: nothing after it raises on ranks > 0
        # Layouts rarely change between saves: send ours only when it did (the all-gather is on
        # the training thread's critical path).
        changed = described != self.sent_tensors
        payload: dict = {
            "busy": busy,
            "step": step,
            "latched": latched,
            "values": values,
            "tensors": described if changed else None,
        }
        self.sent_tensors, self._sent_unchanged = described, not changed
        if self.rank == 0 and latched is None:
            self._precheck(step)
            payload["attempt"] = new_attempt()
        return payload

    def _precheck(self, step: int) -> None:
        self.store.check_root(create=True)
        if self.store.exists(f"{step_dir(step)}/{MANIFEST}"):
            raise CommitError(
                f"step {step} is already committed at {self.store.location.url}; a step is written once: "
                "save under a new step number (committed steps are never overwritten)"
            )

    def _plan(self) -> tuple[dict[str, ArrayPlan], SnapshotLayout]:
        """The save plan and where this rank stages its part of it, recomputed only when some
        rank's tensor layout changed."""
        if self._plan_cache is None:
            plans = plan_arrays(
                [self._peer_tensors[r] for r in range(self.world_size)],
                inner_chunk_bytes=self.config.inner_chunk_bytes,
                max_shard_bytes=self.config.max_shard_bytes,
            )
            self._plan_cache = (plans, snapshot_layout(plans, self.rank))
        return self._plan_cache
