"""resilient.trainer.model: the omni decoder, free of parallelism (see ``resilient.trainer.parallelize``).

Layering: nothing in this package imports ``torch.distributed``; a test scans the sources for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resilient.lazy import lazy_exports

if TYPE_CHECKING:
    from resilient.trainer.model.batch import BATCH_KEYS, Modality, synthetic_batch, validate_batch
    from resilient.trainer.model.config import ModelConfig, flops_per_token, parameter_counts
    from resilient.trainer.model.masking import LossTargets, count_loss_tokens, document_causal_mask, loss_targets
    from resilient.trainer.model.omni import OmniModel, OmniOutput

# Imported on first use: the launcher reads `config` without importing torch (resilient.lazy).
__getattr__ = lazy_exports(
    __name__,
    {
        "BATCH_KEYS": "resilient.trainer.model.batch",
        "Modality": "resilient.trainer.model.batch",
        "synthetic_batch": "resilient.trainer.model.batch",
        "validate_batch": "resilient.trainer.model.batch",
        "ModelConfig": "resilient.trainer.model.config",
        "flops_per_token": "resilient.trainer.model.config",
        "parameter_counts": "resilient.trainer.model.config",
        "LossTargets": "resilient.trainer.model.masking",
        "count_loss_tokens": "resilient.trainer.model.masking",
        "document_causal_mask": "resilient.trainer.model.masking",
        "loss_targets": "resilient.trainer.model.masking",
        "OmniModel": "resilient.trainer.model.omni",
        "OmniOutput": "resilient.trainer.model.omni",
    },
)

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
