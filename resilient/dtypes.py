"""Dtype names shared by torch, numpy, TensorStore and zarr v3, and bfloat16 for zarr-python.

Tensors are stored in their own dtype. bfloat16 has no numpy dtype of its own, so it travels as
``ml_dtypes.bfloat16`` (bit-compatible, zero-copy through an int16 view); zarr-python 3 learns the
name from ``import resilient.zarr_bfloat16``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from resilient.errors import StateError

# torch dtype -> zarr v3 ``data_type`` name (TensorStore's zarr3 driver uses the same names).
_TORCH_TO_ZARR: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
_ZARR_TO_TORCH = {name: dtype for dtype, name in _TORCH_TO_ZARR.items()}

# dtypes numpy cannot hold natively: moved through a same-width integer view.
_VIEW_AS: dict[torch.dtype, tuple[torch.dtype, np.dtype]] = {
    torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
    torch.float8_e4m3fn: (torch.int8, np.dtype(ml_dtypes.float8_e4m3fn)),
    torch.float8_e5m2: (torch.int8, np.dtype(ml_dtypes.float8_e5m2)),
}


def zarr_name(dtype: torch.dtype, *, fqn: str = "?") -> str:
    """The zarr v3 data type name of a torch dtype."""
    try:
        return _TORCH_TO_ZARR[dtype]
    except KeyError:
        raise StateError(
            f"tensor {fqn!r} has dtype {dtype}, which resilient cannot store; "
            f"supported: {', '.join(sorted(_ZARR_TO_TORCH))}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a zarr v3 data type name."""
    return _ZARR_TO_TORCH[name]


def itemsize(name: str) -> int:
    return _ZARR_TO_TORCH[name].itemsize  # a plain lookup: called per array and region of every save


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor, bfloat16/float8 included."""
    if tensor.dtype in _VIEW_AS:
        int_dtype, np_dtype = _VIEW_AS[tensor.dtype]
        return tensor.view(int_dtype).numpy().view(np_dtype)
    return tensor.numpy()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A zero-copy torch view of a numpy array read back from storage."""
    if dtype in _VIEW_AS:
        int_dtype, _ = _VIEW_AS[dtype]
        np_int = {torch.int16: np.int16, torch.int8: np.int8}[int_dtype]
        return torch.from_numpy(np.require(array, requirements="C").view(np_int)).view(dtype)
    return torch.from_numpy(np.require(array, requirements="C"))
