"""resilient: a checkpoint-first, fault-tolerant training runtime for PyTorch.

This module is the package's face: it re-exports the public API from where it lives.
"""

from resilient.dtypes import register_zarr_bfloat16 as _register_zarr_bfloat16
from resilient.errors import (
    CommitError,
    ConfigError,
    IntegrityError,
    QuorumTimeout,
    ResilientError,
    RestoreError,
    StateError,
    StorageError,
)
from resilient.storage.checkpointer import Checkpointer
from resilient.storage.config import CheckpointerConfig
from resilient.storage.handle import SaveHandle

_register_zarr_bfloat16()

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
    "StateError",
    "StorageError",
]
