"""The step-sync seam (trainer/sync.py) and the one train step written over it (trainer/loop.py).

``LocalSync`` is a no-op that always commits. The trainer's step must call the sync where replica
groups meet: a sync that refuses a commit leaves the state untouched (the attempt is retried on the
same batch), and a sync that mirrors two identical groups (every sum doubled) gives the same update
as one group, bit for bit: the loss is normalized by the doubled token count and the halved
gradients are summed back. What a step logs follows the cursor as it is once the step's batch is
taken (a replica group heals inside its quorum, which moves the cursor).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.runfiles import read_jsonl
from resilient.trainer.sync import LocalSync, StepSync
from tests.dist import run_world

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
STEPS = 3

# The tiny recipe on one rank (dp_shard=1, tp=1), steps 1-3, as the trainer logged them before the
# step was written over the sync (single-process run, metrics.jsonl): loss, text_loss, loss_tokens,
# grad_norm, lr. Steps 2-3 re-recorded when building the restore target stopped counting an Adam
# step before step 1 (``trainer.state.state_dicts``): step 1's update took step 2's bias correction.
REFERENCE = [
    (1.359386682510376, 4.1609141031901045, 885, 0.8120774030685425, 0.0015),
    (1.1224398612976074, 3.873537336077009, 873, 0.5792874693870544, 0.003),
    (1.0938278436660767, 3.628162525318287, 899, 0.6886475682258606, 0.003),
]


class _RefuseFirstCommit(LocalSync):
    """Votes the first step attempt down, as a quorum that lost a group mid-step would."""

    def __init__(self) -> None:
        self.votes = 0

    def should_commit(self) -> bool:
        self.votes += 1
        return self.votes > 1


class _TwoIdenticalGroups:
    """Replica groups of identical shards: every cross-group sum doubles the tensor."""

    token_count_dtype = torch.float64

    def allreduce_sum(self, tensor: torch.Tensor) -> bool:
        tensor.mul_(2)
        return True

    def allreduce_gradients(self, params: Any) -> bool:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(2)
        return True

    def should_commit(self) -> bool:
        return True


def test_local_sync_is_identity_and_always_commits() -> None:
    sync: StepSync = LocalSync()
    tensor = torch.tensor([1.5, -2.0], dtype=torch.float64)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 0.25)
    assert sync.allreduce_sum(tensor) and torch.equal(tensor, torch.tensor([1.5, -2.0], dtype=torch.float64))
    assert sync.allreduce_gradients([param]) and torch.equal(param.grad, torch.full((3,), 0.25))
    assert all(sync.should_commit() for _ in range(3))
    # The count keeps its own dtype: .to() returns the same tensor, summed as int64 over dp_shard.
    count = torch.tensor(885)
    assert count.to(sync.token_count_dtype) is count


def _heal_in_first_quorum(trainer: Any) -> None:
    """The data side of a heal inside the first step's quorum, from a peer one step ahead: the
    cursor moves while the step's batch is fetched (only what is logged is checked)."""
    fetch, healed = trainer._next_batch, []

    def next_batch() -> tuple[dict[str, Any], float]:
        if not healed:
            trainer.parts.data.commit_step()
            healed.append(True)
        return fetch()

    trainer._next_batch = next_batch


def _train(rank: int, world: int, root: str) -> dict[str, Any]:
    """Four trainers in this one-rank gloo world; what each logged and counted."""
    from resilient.trainer.config import load_config
    from resilient.trainer.train import build_trainer

    results = {}
    variants = {"local": None, "refused": _RefuseFirstCommit(), "mirrored": _TwoIdenticalGroups(), "healed": None}
    for name, sync in variants.items():
        run_dir = os.path.join(root, name)
        overrides = [
            f"run.dir={run_dir}",
            "parallel.dp_shard=1",
            "parallel.tp=1",
            f"run.steps={STEPS}",
            "data.log_samples=true",
            "data.num_workers=0",
        ]  # rows built in this process: run_world ranks are daemons
        trainer = build_trainer(load_config(TINY, overrides), torch.device("cpu"))
        results[name] = {"default_sync": type(trainer.sync).__name__}
        if sync is not None:
            trainer.sync = sync
        if name == "healed":
            _heal_in_first_quorum(trainer)
        hook_steps: list[int] = []
        trainer.step_hooks.append(lambda step, trainer, seen=hook_steps: seen.append(step))
        try:
            trainer.run()
        finally:
            trainer.close()
        metrics = read_jsonl(trainer.outputs.metrics_path)
        results[name].update(
            step=trainer.step,
            hook_steps=hook_steps,
            logged=[(r["loss"], r["text_loss"], r["loss_tokens"], r["grad_norm"], r["lr"]) for r in metrics],
            steps_logged=[r["step"] for r in metrics],
            samples=[r["sample_ids"] for r in read_jsonl(trainer.outputs.samples_path)],
        )
    return results


def _close_to_reference(logged: list, reference: list) -> bool:
    """Loss, token count and lr to the bit; the gradient norm to a relative 1e-6."""
    return len(logged) == len(reference) and all(
        (loss, text, n, lr) == (r[0], r[1], r[2], r[4]) and norm == pytest.approx(r[3], rel=1e-6)
        for (loss, text, n, norm, lr), r in zip(logged, reference, strict=True)
    )


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_one_step_over_the_sync(tmp_path: Path) -> None:
    [results] = run_world(_train, 1, str(tmp_path), timeout_s=200)
    local, refused, mirrored = results["local"], results["refused"], results["mirrored"]
    assert local["default_sync"] == "LocalSync"
    for run in (local, refused, mirrored):
        assert run["step"] == STEPS and run["hook_steps"] == [1, 2, 3] and run["steps_logged"] == [1, 2, 3]
    # Against the recorded run: the gradient norm's vectorized reduction follows the CPU's vector
    # width (AVX2 and AVX-512 machines differ in its last float32 bit), so it is compared to 1e-6.
    assert _close_to_reference(local["logged"], REFERENCE)
    # The refused attempt changed nothing: the retry trained the same batch from the same state.
    assert refused["logged"] == local["logged"]
    # Two identical groups: the job's token count doubles, every other value is the same to the bit.
    assert [tuple(v) for v in mirrored["logged"]] == [(a, b, 2 * n, c, d) for a, b, n, c, d in local["logged"]]
    assert local["samples"] == refused["samples"] == mirrored["samples"] and len(local["samples"]) == STEPS
    # Healed one step ahead: its step k trained, and logged, the batch the others trained at step k + 1.
    assert results["healed"]["samples"][:2] == local["samples"][1:]
