"""bfloat16 for zarr-python 3: ``import resilient.zarr_bfloat16`` before opening a checkpoint's
bf16 arrays with plain zarr (the dtype is registered on import).

Why an import of its own: resilient itself reads and writes through TensorStore and never needs
zarr-python, and ``import resilient`` must stay cheap (zarr + ml_dtypes cost ~2 s, which the
launcher's config check must not pay). zarr-python 3.1 collects ``zarr.data_type`` entry points but
never loads them, so an entry point would not do it. The dtype is backed by ``ml_dtypes.bfloat16``,
bit-exact both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.float import BaseFloat


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):
    """The zarr v3 ``bfloat16`` data type (the name TensorStore's zarr3 driver writes)."""

    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))
    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _check_native_dtype(cls, dtype: object) -> bool:
        return isinstance(dtype, np.dtype) and dtype == np.dtype(ml_dtypes.bfloat16)

    def to_native_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16)

    @property
    def item_size(self) -> int:
        return 2


def register() -> None:
    """Register the dtype with zarr-python (idempotent; importing this module does it)."""
    data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)


register()
