"""resilient.trainer.model: the omni decoder, free of parallelism (see ``resilient.trainer.parallelize``).

Layering: nothing in this package imports ``torch.distributed``; a test scans the sources for it.
"""

from __future__ import annotations

from resilient.trainer.model.batch import BATCH_KEYS, Modality, synthetic_batch, validate_batch
from resilient.trainer.model.config import ModelConfig, flops_per_token, parameter_counts
from resilient.trainer.model.masking import LossTargets, count_loss_tokens, document_causal_mask, loss_targets
from resilient.trainer.model.omni import OmniModel, OmniOutput

__all__ = [
    "BATCH_KEYS",
    "LossTargets",
    "Modality",
    "ModelConfig",
    "OmniModel",
    "OmniOutput",
    "count_loss_tokens",
    "document_causal_mask",
    "flops_per_token",
    "loss_targets",
    "parameter_counts",
    "synthetic_batch",
    "validate_batch",
]
