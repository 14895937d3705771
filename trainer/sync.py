"""The step-sync seam: what one train step asks of the replica groups it commits with.

``Trainer.train_step`` is written once around three calls and one attribute: sum a tensor over the
replica groups, sum the gradients over them, vote on the commit, and the dtype the loss-token count
is summed in. Within a group the process group (FSDP2, ``dist.all_reduce`` over dp_shard) does the
sums; a sync only adds the groups. Two implementations:

- ``LocalSync`` (here): one replica group, nothing to add: sums are the identity, gradients are left
  as they are, every step commits;
- ``resilient.recovery.quorum.ReplicaGroupSync``: replica groups under a torchft quorum (its
  per-step ``start_step`` is the replicated trainer's business, not the step's).

``LocalSync`` lives here rather than beside ``ReplicaGroupSync``: ``recovery/quorum.py`` imports
torchft (its Manager, gRPC and HTTP transports), which a single-group run must not load; and the
Protocol states what the trainer needs, so the trainer owns it (recovery never imports the trainer:
``ReplicaGroupSync`` matches it structurally).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

__all__ = ["LocalSync", "StepSync"]


class StepSync(Protocol):
    """What one train step asks of its replica groups, in the order it asks."""

    token_count_dtype: torch.dtype
    """dtype the loss-token count is summed in (it becomes the float32 loss normalizer; int64 and
    float64 are both exact below 2**53)."""

    def allreduce_sum(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` in place over the replica groups; False if the sum failed (the step will
        not commit)."""
        ...

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Sum every parameter's local gradient in place over the replica groups."""
        ...

    def should_commit(self) -> bool:
        """Whether this step commits: the optimizer steps and the data cursor moves only then."""
        ...


class LocalSync:
    """One replica group: nothing to sum with, and every step commits."""

    token_count_dtype = torch.int64
    """The count's own dtype (``count_loss_tokens`` returns int64): summed over dp_shard as it is."""

    def allreduce_sum(self, tensor: torch.Tensor) -> bool:
        return True

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return True

    def should_commit(self) -> bool:
        return True
