"""resilient: a checkpoint-first, fault-tolerant training runtime for PyTorch.

This module is the package's face: it re-exports the public API from where it lives. The errors are
imported at once (they are tiny); the checkpoint API on first use (``resilient.lazy``), so that a
config check or a tool's ``--help`` does not pay for torch and TensorStore. zarr-python learns
bfloat16 from ``import resilient.zarr_bfloat16``.
"""

from typing import TYPE_CHECKING

from resilient.errors import (
    CommitError,
    ConfigError,
    IntegrityError,
    QuorumTimeout,
    ResilientError,
    RestoreError,
    StagingTimeout,
    StateError,
    StorageError,
)
from resilient.lazy import lazy_exports

if TYPE_CHECKING:
    from resilient.storage.checkpointer import Checkpointer
    from resilient.storage.config import CheckpointerConfig
    from resilient.storage.handle import SaveHandle

__getattr__ = lazy_exports(
    __name__,
    {
        "Checkpointer": "resilient.storage.checkpointer",
        "CheckpointerConfig": "resilient.storage.config",
        "SaveHandle": "resilient.storage.handle",
    },
)

__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "CommitError",
    "ConfigError",
    "IntegrityError",
    "QuorumTimeout",
    "ResilientError",
    "RestoreError",
    "SaveHandle",
    "StagingTimeout",
    "StateError",
    "StorageError",
]
