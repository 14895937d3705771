"""The training loop of one replica group: resume, step, log, checkpoint, hooks.

One step on every rank, written once for a lone group and for replica groups: take this
data-parallel share's batch (the same batch until committed), sum the loss-token count over
dp_shard and then over the replica groups so the summed gradients are those of the global mean
loss, forward/backward, sum the gradients over the groups, clip, and if the step commits AdamW +
schedule and move the data cursor; then save if due, log, and run the step hooks. Gradients are
summed over dp_shard by FSDP2 (divide factor 1): see ``resilient.trainer.parallelize``. What crosses
the groups goes through ``self.sync`` (``resilient.trainer.sync``): ``LocalSync`` here,
torchft's ``ReplicaGroupSync`` in ``resilient.trainer.replicated``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from resilient import dist as rdist
from resilient.errors import CommitError, ResilientError
from resilient.faults import fault_point
from resilient.recovery.ram import RamTier
from resilient.recovery.restore import PeerHeal, RestoreResult, restore
from resilient.recovery.restore import committed_steps as list_committed
from resilient.runfiles import group_id, write_event
from resilient.storage.checkpointer import Checkpointer
from resilient.storage.handle import SaveHandle
from resilient.trainer.build import StepHook, load_step_hooks, reinitialize
from resilient.trainer.cadence import Cadence
from resilient.trainer.config import TrainConfig
from resilient.trainer.model import BATCH_KEYS, OmniOutput, count_loss_tokens, flops_per_token
from resilient.trainer.observing.observe import RunObserver
from resilient.trainer.observing.outputs import RunOutputs, StepStats, sort_sample_ids
from resilient.trainer.observing.peak import Peak
from resilient.trainer.preempt import Preempted, PreemptWatch, preempt_signals, stop_trainer
from resilient.trainer.state import TrainingParts, apply_state, capture_state
from resilient.trainer.sync import LocalSync, StepSync

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    """What one optimizer step reports, reduced over the data-parallel ranks."""

    loss: float
    text_loss: float
    loss_tokens: int
    grad_norm: float
    lr: float
    committed: bool
    """The sync committed the step: the optimizer stepped (else it is retried on the same batch)."""
    data_skipped: int = 0
    """Documents of the global batch that could not be built (their slots were padding)."""
    preempt: int = 0
    """The preemption signal some rank (of any participating group) got before this committed step's
    sums: every rank stops after this step (``trainer.preempt``); 0 if none did."""


class Trainer:
    """Owns the run's pieces and drives them. ``step_hooks`` (callables of (step, trainer)) run on
    every rank after each committed step: the seam for fault injection and custom monitoring."""

    def __init__(
        self,
        config: TrainConfig,
        mesh: DeviceMesh,
        parts: TrainingParts,
        checkpointer: Checkpointer,
        outputs: RunOutputs,
        device: torch.device,
        observer: RunObserver,
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.parts = parts
        self.checkpointer = checkpointer
        self.outputs = outputs
        self.device = device
        self.dp_group = mesh["dp_shard"].get_group()
        self.pp_group = mesh["pp"].get_group() if parts.stages is not None else None
        """The ranks of this rank's pipeline (None without pipelining)."""
        self.tp_group = mesh["tp"].get_group() if mesh["tp"].size() > 1 else None
        first_stage = parts.stages is None or mesh["pp"].get_local_rank() == 0
        self._logs_group_skips = first_stage and mesh["tp"].get_local_rank() == 0
        """Whether this rank speaks for the ranks that share its rows (tp peers, pipeline stages)."""
        self.sync: StepSync = LocalSync()
        """Sums and commit vote across replica groups (ReplicatedTrainer puts its torchft sync here)."""
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from: int | None = None
        self.restored_from = "fresh"
        """Where ``resume`` got the state: "peer", "own" / "buddy" (RAM), "persistent" or "fresh"."""
        self.step_hooks: list[StepHook] = []
        self.before_compute: list[Callable[[int], None]] = []
        """Called with the step being computed, on this rank, before the step's first collective
        (inside its compute time): where ``resilient-chaos`` makes a rank slow (``slow_rank``)."""
        self._pending_save: SaveHandle | None = None
        self.ram: RamTier | None = None
        self._saved_step: int | None = None
        data = config.data.pipeline
        self.tokens_per_step = data.global_rows * data.row_len
        self._flops_per_step = flops_per_token(config.model, data.row_len) * self.tokens_per_step
        self.observer = observer
        self.phases = observer.phases
        self.cadence = Cadence.for_run(config, world=mesh.size())
        """The checkpoint intervals (``checkpoint.cadence``): fixed, or re-chosen as the run goes."""
        self.peak_flops = config.run.peak_flops
        """FLOP/s of one rank's device, the MFU denominator (``trainer/observing/peak.py``, set by build_trainer)."""
        self.peak: Peak | None = None
        """Where ``peak_flops`` came from; a measured one rises to what a step achieves (MFU <= 1)."""
        self.preemption = PreemptWatch(preempt_signals(config.run.preempt_signal))
        """Installed around ``run`` by the entry point: a SIGTERM (or ``run.preempt_signal``) makes
        the ranks save the current step and stop (``trainer.preempt``)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def install_configured_hooks(self) -> None:
        self.step_hooks.extend(load_step_hooks(self.config.run.step_hooks, self))

    def resume(self, peer: PeerHeal | None = None) -> RestoreResult:
        """Restore the newest state any tier holds, decided by all ranks together before anything is
        loaded (``resilient.recovery.restore``: peer, own RAM, buddy RAM, persistent, fresh): the RAM
        tier's newest common step when it is not older than the newest committed checkpoint, else
        that checkpoint (on any mesh), else a fresh start. ``peer``: the heal of the first quorum."""
        p = self.config.parallel
        result = restore(
            lambda: capture_state(self.parts, self.step, self.tokens_seen),
            self._apply_restored,
            checkpointer=self.checkpointer,
            ram=self.ram,
            run_dir=self.config.run.dir,
            peer=peer,
            resume=self.config.checkpoint.resume,
            say=self.outputs.message,
            layout=p.describe(),
            load_step=self.config.checkpoint.load_step,
            reinit=lambda: reinitialize(self.config, self.mesh, self.device, self.parts),
        )
        self.restored_from = result.source
        self.observer.restore_sources = result.group_sources or [result.source]
        if self.cadence.adaptive:  # the intervals the run had reached go on after a restart
            self._cadence_events(self.cadence.take(rdist.agree(self.cadence.resumed, src=0, what="checkpoint cadence")))
            self.cadence.started(self.step)
        assert result.timeline is not None  # every restore reads the root's run id
        self.observer.restored(result.timeline.run_id)
        if result.loaded:
            self.resumed_from = self._saved_step = result.step
        return result

    def _apply_restored(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = apply_state(self.parts, state)

    def committed_steps(self) -> list[int]:
        """Committed checkpoint steps, the same list (or error) on every rank (collective)."""
        return list_committed(self.checkpointer)

    def run(self) -> None:
        """Train until ``run.steps`` steps are committed, checkpointing on the way and at the end."""
        self.resume()
        if self.step >= self.config.run.steps:
            self.outputs.message(f"step {self.step} >= run.steps={self.config.run.steps}: nothing to train")
            self.persist_restored()
        while self.step < self.config.run.steps:
            self._iteration()
        self.finish()

    def persist_restored(self) -> None:
        """A run restored from RAM at (or past) its last step has nothing left to train, and its
        final state may exist only in RAM (the final save failed, then the job restarted): save it
        now (collective; every rank decides alike). Earlier steps need nothing here: the last
        step's save covers them. A peer group that committed the same step first is no error."""
        if self.restored_from not in ("own", "buddy") or self.step in self.committed_steps():
            return
        self._saved_step = None
        try:
            self.save()
            self.checkpointer.wait()
        except CommitError:  # raised on every rank alike (agreed in save/wait)
            if self.step not in self.committed_steps():
                raise

    def _stop_preempted(self, signum: int) -> Preempted:
        """Save the current step (if this group writes it), wait for its commit, record the event."""
        with self.observer.paused():  # the save may take long: not a hang
            return stop_trainer(self, signum)

    # -- one step ----------------------------------------------------------------------------

    def _iteration(self) -> None:
        """One step attempt. A committed step moves the data cursor and the step count, saves and
        snapshots when due, logs and runs the step hooks; a step the sync did not commit changes
        nothing and is tried again (same global batch). A committed step whose sums say the job was
        asked to stop (a preemption signal on any rank) is saved, and the run stops there."""
        self.observer.attempt(self.step)
        start = time.perf_counter()
        batch, data_wait = self._next_batch()
        self.phases.add("data_wait_s", data_wait)
        # Read after _next_batch: a replica group that heals in its quorum gets its peer's cursor there.
        cursor = self.parts.data.cursor
        result = self.train_step(batch)
        self._record_attempt(result)
        if not result.committed:
            self.phases.discard()
            return
        self.parts.data.commit_step()
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        stall_start = time.perf_counter()
        blocked = self._checkpoint_if_due()
        ckpt_stall = time.perf_counter() - stall_start
        step_time = time.perf_counter() - start
        self.outputs.step(self._stats(result, step_time, data_wait, ckpt_stall))
        self.observer.committed(self.step, step_time)
        self.cadence.observe(step_time, blocked)
        if self.cadence.decides_at(self.step):
            self._retune()
        if self._logs_group_skips:  # the ranks of a TP group and of a pipeline share their rows: once
            self.outputs.skipped(self.step, batch.get("skipped", []), rank=rdist.get_rank())
        if self.config.data.log_samples:
            # The whole global batch's ids, from the cursor: the same on every rank and in every group.
            self.outputs.samples(self.step, sort_sample_ids(set(self.parts.data.sample_ids_for_step(cursor))))
        for hook in self.step_hooks:
            hook(self.step, self)
        if result.preempt and self.step < self.config.run.steps:  # the last step ends the run anyway
            raise self._stop_preempted(result.preempt)

    def _next_batch(self) -> tuple[dict[str, Any], float]:
        """This rank's share of the global batch at the data cursor (prefetched), and the seconds
        spent waiting for it."""
        start = time.perf_counter()
        batch = self.parts.data.next_batch()
        return batch, time.perf_counter() - start

    def _record_attempt(self, result: StepResult) -> None:
        """Called after every step attempt, committed or not (replica groups log their quorum)."""

    def train_step(self, batch: dict[str, Any]) -> StepResult:
        """Forward, backward, clip and, if the step commits, update, on this rank's share of a global
        batch. Every sum runs over dp_shard (the process group), then over the replica groups (the
        sync), in that order."""
        stop_flags = self.preemption.start_flags(self.tp_group)
        with self.phases.timed("compute_s"):
            # Tests and resilient-chaos make one rank slow here, before the step's first collective:
            # its peers then wait in that collective (grad_sync_s). Later in the step a slow rank
            # shows on every rank alike (FSDP2's all-gathers wait inside forward and backward).
            fault_point("trainer.compute")
            for hook in self.before_compute:
                hook(self.step + 1)
            inputs = {key: batch[key].to(self.device, non_blocking=True) for key in BATCH_KEYS}
            global_tokens = count_loss_tokens(inputs).to(self.sync.token_count_dtype)
        with self.phases.timed("grad_sync_s"):
            dist.all_reduce(global_tokens, op=dist.ReduceOp.SUM, group=self.dp_group)
            self.sync.allreduce_sum(global_tokens)
        with self.phases.timed("compute_s"):  # FSDP2's reduce-scatter runs inside backward: counted here
            outs = self._forward_backward(inputs, global_tokens)
        with self.phases.timed("grad_sync_s"):
            # FSDP2 summed the gradients over dp_shard; summing over the groups makes the gradient of
            # the global mean loss, identical bits in every group (one reduction result, broadcast).
            self.sync.allreduce_gradients(self.parts.model.parameters())
            grad_norm = self._clip_gradients()
        sums = self._loss_sums(outs, len(batch.get("skipped", ())), self.device)
        # The durable interval's vote and the preemption flags ride on the step's sums, summed like the loss.
        riders = [self.cadence.vote, 1.0, *stop_flags.wait()]
        sums = torch.cat([sums, torch.tensor(riders, dtype=sums.dtype, device=sums.device)])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.dp_group)
        if self.pp_group is not None:  # only the last stage's ranks hold the loss
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.pp_group)
        self.sync.allreduce_sum(sums)
        lr = self.parts.optimizer.param_groups[0]["lr"]
        committed = self.sync.should_commit()
        with self.phases.timed("optimizer_s"):
            if committed:
                if self._pending_save is not None:
                    # Under CUDA the last save's snapshot copy may still run on a side stream: the update
                    # must not change the parameters under it (a no-op on CPU, where the copy is done).
                    self._pending_save.wait_staged()
                self.parts.optimizer.step()
                self.parts.scheduler.step()
            self.parts.optimizer.zero_grad(set_to_none=True)
        loss, text_sum, text_tokens, data_skipped, votes, voters, *stops = sums.tolist()
        if committed:  # an uncommitted step's sums may hold only this group's vote
            self._cadence_events(self.cadence.voted(votes, voters))
        return StepResult(
            loss=loss,
            text_loss=text_sum / max(text_tokens, 1.0),
            loss_tokens=int(global_tokens),
            grad_norm=grad_norm,
            lr=lr,
            committed=committed,
            data_skipped=int(data_skipped),
            preempt=self.preemption.agreed_signal(stops) if committed else 0,
        )

    def _forward_backward(self, inputs: dict[str, torch.Tensor], global_tokens: torch.Tensor) -> list[OmniOutput]:
        """Gradients of this rank's share of the step into ``.grad``; the outputs that carry the
        loss (one, or under pipelining one per microbatch on the last stage and none elsewhere)."""
        if self.parts.stages is not None:
            return self.parts.stages.step(inputs, global_tokens)
        out = self.parts.model(inputs, loss_normalizer=global_tokens)
        out.loss.backward()
        return [out]

    @staticmethod
    def _loss_sums(outs: list[OmniOutput], skipped: int, device: torch.device) -> torch.Tensor:
        """[loss, text loss sum, text tokens, skipped documents] of this rank, to be summed over the
        data-parallel ranks (and pipeline stages: only ranks with outputs count the skipped). On the
        device on every rank: the process group picks gloo or NCCL by the tensor's device."""
        if not outs:
            return torch.zeros(4, dtype=torch.float64, device=device)
        rows = [
            torch.stack([o.loss.detach().double(), o.text_loss_sum.double(), o.num_text_tokens.double()]) for o in outs
        ]
        counted = torch.tensor([float(skipped)], dtype=torch.float64, device=device)
        return torch.cat([torch.stack(rows).sum(0).to(device), counted])

    def _clip_gradients(self) -> float:
        # inf when clipping is off: still returns the norm for the metrics, and scales by exactly 1.
        max_norm = self.config.optim.grad_clip or math.inf
        params = list(self.parts.model.parameters())
        if self.pp_group is None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            return float(norm)
        # Each stage holds some of the parameters: the total norm sums the stages' squared norms
        # (as torchtitan's pipeline-aware clip does), then every stage scales by the same factor.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.double().pow(2)
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
        total = squared.sqrt().to(norm.dtype)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    def _stats(self, result: StepResult, step_time: float, data_wait: float, ckpt_stall: float) -> StepStats:
        return StepStats(
            step=self.step,
            loss=result.loss,
            text_loss=result.text_loss,
            tokens=self.tokens_per_step,
            loss_tokens=result.loss_tokens,
            lr=result.lr,
            grad_norm=result.grad_norm,
            step_time_s=step_time,
            data_wait_s=data_wait,
            ckpt_stall_s=ckpt_stall,
            data_skipped=result.data_skipped,
            tokens_per_s=self.tokens_per_step / step_time,
            mfu=self._mfu(step_time),
            peak_flops=self.peak_flops,
        )

    def _mfu(self, step_time: float) -> float:
        achieved = self._flops_per_step / step_time / self.mesh.size()  # per rank, as the peak
        if self.peak is not None:
            self.peak_flops = self.peak.at_least(achieved)
        return achieved / self.peak_flops

    # -- checkpoints -------------------------------------------------------------------------

    def _checkpoint_if_due(self) -> dict[str, float]:
        """Save and snapshot when due; the seconds each tier that ran blocked the step."""
        blocked = {}
        saved_before, start = self._saved_step, time.perf_counter()
        with self.phases.timed("ckpt_stall_s"):
            self.maybe_save()
        if self._saved_step != saved_before:
            blocked["persist"] = time.perf_counter() - start
        start = time.perf_counter()
        with self.phases.timed("snapshot_s"):
            snapped = self.maybe_snapshot()
        if snapped:
            blocked["memory"] = time.perf_counter() - start
        return blocked

    def _retune(self) -> None:
        """Adaptive cadence: rank 0's proposal for every rank of the group (one broadcast); the
        RAM interval changes now, the durable one with the next step's vote (``train_step``)."""
        cadence = self.cadence
        proposal = rdist.agree(cadence.propose, src=0, what="checkpoint cadence")
        self._cadence_events(cadence.take(proposal))

    def _cadence_events(self, changes: list[dict[str, Any]]) -> None:
        for change in changes:
            if self.outputs.enabled:  # the group's rank 0
                write_event(self.config.run.dir, "cadence", group=group_id(), step=self.step, **change)
            log.info("checkpoint cadence: %s every %d steps", change["tier"], change["every_steps"])

    def is_due(self, every: int, *, at_end: bool = False) -> bool:
        """Whether a cadence of ``every`` steps (0: never) falls on the current step; with
        ``at_end``, the run's last step is due too."""
        return (every > 0 and self.step % every == 0) or (at_end and self.step == self.config.run.steps)

    def maybe_save(self) -> None:
        """Save every ``persist_every`` steps and at the last step (once per step), if this trainer
        writes the step (``saves_this_step``)."""
        due = self.is_due(self.cadence.persist_every, at_end=True)
        if due and self._saved_step != self.step and self.saves_this_step():
            self.save()

    def saves_this_step(self) -> bool:
        """A lone group writes every due step (replica groups: one group per step)."""
        return True

    def maybe_snapshot(self) -> bool:
        """RAM tier: snapshot into the node store every ``memory_every`` steps (a memcpy; the
        checksum, publish and buddy copy run in the background). Whether it did."""
        if self.ram is not None and self.is_due(self.cadence.memory_every):
            self.ram.snapshot(self.step, capture_state(self.parts, self.step, self.tokens_seen))
            return True
        return False

    def save(self) -> SaveHandle:
        """Checkpoint the current step. Returns once the state is staged; it persists and commits in
        the background. A background failure of an earlier save is raised here, on every rank
        together (the Checkpointer latches it), or at the end of the run."""
        if self.step >= self.config.run.steps:
            # The last checkpoint must not be skipped as busy (if_busy="skip"): drain first.
            self.checkpointer.wait()
        state = capture_state(self.parts, self.step, self.tokens_seen)
        metadata = {
            "config": self.config.to_dict(),
            "world_size": self.mesh.size(),
            "mesh": dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape, strict=True)),
        }
        handle = self.checkpointer.save(self.step, state, metadata=metadata)
        if handle.done() and handle.stats is not None and handle.stats.outcome == "skipped":
            log.warning(
                "[rank %d] checkpoint of step %d skipped: the previous save is still persisting",
                rdist.get_rank(),
                self.step,
            )
            return handle
        self._pending_save = handle
        self._saved_step = self.step
        return handle

    def finish(self) -> None:
        """Wait (bounded by checkpoint.timeout_s) until every save in flight is committed, and until
        every rank's last RAM snapshot reached its buddy (no rank closes its channel while a peer
        still sends to it); then make sure the run's last step is committed to ``checkpoint.url``.
        Every check is one agreement: each rank raises the same error, or none does (a rank
        raising alone would leave its peers in the next collective until its timeout)."""
        with self.observer.paused():  # the last save may take long: not a hang
            self.checkpointer.wait()
        self._pending_save = None
        if self.ram is not None:
            ram, timeout = self.ram, self.config.recovery.replication_timeout_s
            rdist.agree(lambda: ram.wait(timeout), what="RAM replication")  # also the barrier
        if self.step == 0:
            return  # nothing trained nor restored (run.steps=0 on a fresh root): the initial state
        committed = self._final_committed_steps()
        if self.step not in committed:
            newest = committed[-1] if committed else "none"
            raise ResilientError(
                f"the run ended at step {self.step} but that step is not committed to "
                f"{self.checkpointer.url} (newest committed: {newest}): the final state would exist "
                "only in memory; rerun the same command to resume and save it"
            )

    def _final_committed_steps(self) -> list[int]:
        """Committed steps, as every rank sees them at the end."""
        return self.settled_steps(time.monotonic() + self.config.checkpoint.timeout_s)

    def settled_steps(self, deadline: float) -> list[int]:
        """Committed steps once the current step's writer had its chance (collective): a lone group
        wrote and waited for it itself; replica groups wait until ``deadline`` (``time.monotonic``)
        for the group that writes it."""
        return self.committed_steps()

    def close(self) -> None:
        """Stop the loader's workers and the checkpoint writer, close the output files. Raises a
        background save error that nothing has raised yet."""
        try:
            if self.peak is not None and self.outputs.enabled:  # one rank writes the cache
                self.peak.remember()
            self.observer.close()
            self.parts.data.close()
            self.outputs.close()
        finally:
            try:
                if self.ram is not None:
                    self.ram.close()
            finally:
                self.checkpointer.close()
