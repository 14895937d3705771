"""The trainer as one replica group of several: a step commits across the groups of its quorum.

The step itself is ``Trainer``'s, over a torchft ``ReplicaGroupSync`` instead of ``LocalSync``: the
loss is normalized by the token count summed over every share of every participating group, and
gradients are summed across groups, so the update does not depend on how many groups took part; the
optimizer steps, and the data cursor moves, only if ``should_commit()`` (a failed step is retried on
the same global batch with the new quorum). What is replica-specific lives here:

- each step attempt starts with a torchft quorum; a group that is behind heals inside it from a
  live peer (model, optimizer, scheduler, data cursor, step: no storage read) and trains that same
  step (the heal callbacks ``_heal_state`` / ``_load_heal_state``);
- exactly-once data: the global batch at the cursor is split over the PARTICIPATING groups
  (share = participating_rank x dp_shard + dp_rank of participants x dp_shard);
- a persistent checkpoint is written once per step, by the group of participating rank 0 (the
  storage commit protocol makes a group dying mid-save leave no committed step);
- ``samples.jsonl`` lists the whole job's sample ids of every step this group committed;
- rank 0 of each group appends the step's quorum to ``<run.dir>/events.jsonl``;
- every group sees the same checkpoint root: each group's rank 0 leaves a token there before it
  first joins a quorum, and reads the token of each member of its quorums it has not seen before
  (``storage.shared.check_group_tokens``), refusing the run with a ConfigError otherwise.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from typing import Any

from torch.distributed.checkpoint.state_dict import set_state_dict

from resilient import dist as rdist
from resilient.errors import ResilientError
from resilient.faults import fault_point
from resilient.recovery.channel import bind_host, job_secret, secret_fingerprint
from resilient.recovery.ownership import job_identity
from resilient.recovery.quorum import QuorumInfo, ReplicaGroupSync
from resilient.recovery.restore import PeerHeal
from resilient.runfiles import FINAL_DIGEST, EventLog, group_id
from resilient.state import state_digest
from resilient.storage.shared import check_group_tokens, remove_group_token, write_group_token
from resilient.trainer.loop import StepResult, Trainer
from resilient.trainer.schedule import load_scheduler_state, scheduler_state
from resilient.trainer.state import state_dicts

log = logging.getLogger(__name__)


class ReplicatedTrainer(Trainer):
    """A ``Trainer`` whose steps commit through a torchft quorum of replica groups."""

    sync: ReplicaGroupSync

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group_id()
        self.rank = rdist.get_rank()
        self.events = EventLog(self.config.run.dir, enabled=self.rank == 0)
        self.last_quorum: QuorumInfo | None = None
        """The quorum of the current (or last) step attempt."""
        self._joined: QuorumInfo | None = None
        """A quorum already joined for the next step attempt (the run's first, see ``run``)."""
        self.heals: list[dict[str, Any]] = []
        self._unproven: dict[str, str] = {}
        # The optimizer's state exists in EVERY group up front (a group serving a heal needs it), so
        # nothing about it depends on who served whom (a storage restore overwrites it anyway).
        state_dicts(self.parts.model, self.parts.optimizer)
        secret = job_secret(self.config.run.dir)
        self._secret_fingerprint = secret_fingerprint(secret)
        self._seen_members: set[str] = set()
        """Quorum members whose token this group found under the checkpoint root (or that name no
        group: no token to find)."""
        self.sync = ReplicaGroupSync(
            self.config.replica,
            group=self.group,
            rank=self.rank,
            world_size=self.mesh.size(),
            state_dict=self._heal_state,
            load_state_dict=self._load_heal_state,
            secret=secret,
            host=bind_host(self.config.recovery),
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> None:
        store, job, group = self.checkpointer.store, job_identity(), self.group
        token = functools.partial(
            write_group_token, store, group, member=self.sync.replica_id, job=job, secret=self._secret_fingerprint
        )
        rdist.agree(token, src=0, what="writing the group's shared-root token")  # before any quorum sees us
        self._joined = self._first_quorum()
        if self.step >= self.config.run.steps:
            self.persist_restored()
        while self.step < self.config.run.steps:
            self._iteration()
        self.finish()
        self.write_final_digest()
        self.events.write("done", group=self.group, step=self.step)
        if self.rank == 0:  # no later quorum lists this group's member id: nobody reads its token
            remove_group_token(self.checkpointer.store, self.group)

    def _first_quorum(self) -> QuorumInfo | None:
        """Where this group's state comes from: a live peer if the quorum has one ahead (healed
        inside the first quorum, no storage read), else the newest committed checkpoint.

        Every group of a step-0 quorum is fresh (a whole-job start or restart) and takes the same
        decision from the same storage: all restore and skip the step (nobody enters its
        collectives), then meet again at the restored step. Returns the quorum to train in, or None.
        """
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.events.write("joining", group=self.group, attempt=attempt)
        quorum = self.sync.start_step()
        self._check_shared_root(quorum)
        if quorum.healed and quorum.step > 0:
            heal = self.heals[-1] if self.heals else {"bytes": 0}
            self.resume(peer=PeerHeal(step=self.step, bytes=heal["bytes"], seconds=quorum.heal_s))
        elif quorum.step == 0 and self.resume().loaded:
            self.sync.restore_step(self.step)
            quorum = None
        # One vocabulary: own | buddy | persistent | peer | fresh.
        self.events.write(
            "start",
            group=self.group,
            step=self.step,
            source=self.restored_from,
            attempt=attempt,
            heal_bytes=self.heals[-1]["bytes"] if self.heals else 0,
        )
        return quorum

    def _check_shared_root(self, quorum: QuorumInfo) -> None:
        """Every member of the quorum writes to the checkpoint root this group reads: rank 0 reads
        each new member's token (collective; the same ConfigError on every rank otherwise). A member
        that could not prove it holds the job secret counts only if its token is this job's.

        The run directory need not be one place for every group: what a group reads there it wrote
        itself (events, metrics, its timeline record), except the job secret when
        ``$RESILIENT_JOB_SECRET`` is unset (``<run.dir>/job.key``); a group that made its own
        names another secret's fingerprint in its token, refused here, naming run.dir."""
        new = sorted(m for m in quorum.members if m != self.sync.replica_id and m not in self._seen_members)
        if not new:
            return
        groups = {m: _group_of(m) for m in new}
        unnamed = [m for m, group in groups.items() if group is None]
        if unnamed:  # a stranger (it may name itself anything): there is no token to read for it
            reason = "its member id names no replica group"
            self.events.write(
                "quorum_unproven", group=self.group, step=quorum.step + 1, members=dict.fromkeys(unnamed, reason)
            )
        rounds = _token_rounds(groups, quorum.unproven)
        store, job, secret = self.checkpointer.store, job_identity(), self._secret_fingerprint

        def check() -> None:
            for members in rounds:
                check_group_tokens(store, self.group, members, job=job, secret=secret)

        rdist.agree(check, src=0)  # its line names the setting and the groups: no more context needed
        # One that could not prove itself is asked again; one naming no group has nothing to ask.
        self._seen_members |= (set(new) - set(quorum.unproven)) | set(unnamed)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.events.close()
            self.sync.shutdown()

    # -- healing state -----------------------------------------------------------------------

    def _heal_state(self) -> dict[str, Any]:
        """What a healing peer of this group rank receives. JSON parts are the same in every group
        (per-group data positions derive from the quorum, never from this state)."""
        model_state, optim_state = state_dicts(self.parts.model, self.parts.optimizer)
        return {
            "model": model_state,
            "optim": optim_state,
            "scheduler": scheduler_state(self.parts.scheduler),
            "data": self.parts.data.state_dict(),
            "train": {"step": self.step, "tokens_seen": self.tokens_seen},
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        # Tests: die or stall mid-heal (state fetched, nothing applied), e.g. only in the first
        # restart: RESILIENT_FAULTS="replica.heal_load.attempt1=pause:60@rank1".
        fault_point(f"replica.heal_load.attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        transport = self.sync.transport
        self.heals.append(
            {"step": int(state["train"]["step"]), "bytes": transport.last_recv_bytes, "fetch_s": transport.last_recv_s}
        )
        parts = self.parts
        set_state_dict(parts.model, parts.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        load_scheduler_state(parts.scheduler, state["scheduler"])
        parts.data.load_state_dict(state["data"])
        self.step, self.tokens_seen = int(state["train"]["step"]), int(state["train"]["tokens_seen"])

    # -- one step: quorum, batch share, step event (the step itself is Trainer.train_step) ------

    def _next_batch(self) -> tuple[dict[str, Any], float]:
        """Join this attempt's quorum (healing first if behind), then take this group's share of
        the global batch at the cursor. The wait excludes the time spent in the quorum."""
        start = time.perf_counter()
        quorum, self._joined = self._joined or self.sync.start_step(), None
        self._check_shared_root(quorum)
        self.last_quorum = quorum
        if quorum.unproven and quorum.unproven != self._unproven:
            # A member that cannot prove it holds the job secret: this group does not commit (nor
            # send anything across groups) while it is in the quorum (``recovery.quorum_auth``).
            self.events.write("quorum_unproven", group=self.group, step=quorum.step + 1, members=quorum.unproven)
        self._unproven = quorum.unproven
        if quorum.step != self.step:
            raise ResilientError(
                f"[group {self.group} rank {self.rank}] torchft is at step {quorum.step} but the trainer at "
                f"{self.step}: the heal state and the Manager disagree (a bug)"
            )
        if quorum.num_participants > self.config.replica.groups:
            raise ResilientError(
                f"{quorum.num_participants} groups in the quorum but replica.groups={self.config.replica.groups}: "
                f"launch with --replica-groups matching the job (members: {quorum.members})"
            )
        dp = self.config.parallel.dp_shard
        share = quorum.participating_rank * dp + self.mesh["dp_shard"].get_local_rank()
        batch = self.parts.data.batch_for_step(self.parts.data.cursor, share, quorum.num_participants * dp)
        return batch, time.perf_counter() - start - quorum.quorum_s

    def _record_attempt(self, result: StepResult) -> None:
        """Rank 0 of each group appends the attempt and its quorum to ``<run.dir>/events.jsonl``."""
        quorum = self.last_quorum
        assert quorum is not None
        self.events.write(
            "step",
            group=self.group,
            step=quorum.step + 1,
            committed=result.committed,
            quorum_id=quorum.quorum_id,
            members=quorum.members,
            participants=quorum.num_participants,
            participating_rank=quorum.participating_rank,
            healed=quorum.healed,
            heal_bytes=quorum.heal_bytes,
            heal_s=round(quorum.heal_s, 4),
            quorum_s=round(quorum.quorum_s, 4),
        )
        if not result.committed:
            log.warning(
                "[group %d rank %d] step %d not committed; retrying it with a new quorum",
                self.group,
                self.rank,
                quorum.step + 1,
            )

    def saves_this_step(self) -> bool:
        """One group writes each persistent checkpoint: the group of participating rank 0, and not
        a step some other group already committed to storage (a group finishing alone after its
        peers may reach a step they saved)."""
        if self.last_quorum is None:
            return False  # no step trained yet (a preemption at start): the state came from a peer or storage
        return self.last_quorum.participating_rank == 0 and self.step not in self.committed_steps()

    # -- end of run --------------------------------------------------------------------------

    def settled_steps(self, deadline: float) -> list[int]:
        """The current step is written by one group (``saves_this_step``), maybe not this one: wait
        for its commit until ``deadline`` (``time.monotonic``). Rank 0 lists and judges the time for
        the whole group, so every rank leaves the loop at the same poll."""
        delay = 0.05
        while True:
            got = rdist.agree(
                lambda: {"steps": self.checkpointer.steps(), "late": time.monotonic() > deadline},
                src=0,
                what="listing committed checkpoints",
            )
            if self.step in got["steps"] or got["late"]:
                return got["steps"]
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def write_final_digest(self) -> dict[str, Any]:
        """sha256 of the full parameters and optimizer state (collective within the group); rank 0
        writes it to ``<group dir>/final.json``. Groups that ended in the same state match bit for bit."""
        model_state, optim_state = state_dicts(self.parts.model, self.parts.optimizer)
        digest = {
            "step": self.step,
            # Over the pipeline's ranks: every stage's tensors count, not rank 0's alone.
            "params_sha256": state_digest(model_state, group=self.pp_group),
            "optim_sha256": state_digest(optim_state["state"], group=self.pp_group),
            "heals": self.heals,
        }
        if self.outputs.enabled:
            with open(os.path.join(self.outputs.directory, FINAL_DIGEST), "w") as f:
                json.dump(digest, f, indent=1)
        return digest


def _group_of(member: str) -> int | None:
    """The replica group a quorum member id names (``group00001:...``, ``replica_name``); None for
    an id of another form (anyone can register any id with the lighthouse)."""
    named = re.fullmatch(r"group([0-9]+)", member.split(":", 1)[0])
    return int(named.group(1)) if named else None


def _token_rounds(groups: dict[str, int | None], unproven: dict[str, str]) -> list[dict[int, tuple[str, bool]]]:
    """``check_group_tokens``'s arguments for the members ``groups`` names (member -> its group):
    one token per group, but a stranger may call itself any group, so each member is checked on its
    own account (as many rounds as members naming one group) and none hides another."""
    rounds: list[dict[int, tuple[str, bool]]] = []
    for member, group in groups.items():
        if group is None:
            continue
        free = next((r for r in rounds if group not in r), None)
        if free is None:
            free = {}
            rounds.append(free)
        free[group] = (member, member not in unproven)
    return rounds
