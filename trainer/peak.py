"""The peak FLOP/s one rank can reach: the denominator of MFU.

MFU against a wrong peak is a wrong number that looks right (a CPU run "at 0.00001 % MFU" of an
H100's 989 TFLOP/s, or an H20 reported against H100 numbers). So the peak says where it came from:

- ``config``: the recipe's ``run.peak_flops`` override, when > 0;
- ``table:<name>``: a CUDA device whose name matches a row of ``PEAK_FLOPS`` (dense bf16/fp16
  tensor-core peak from the vendor's datasheet), when training in bf16/fp16;
- ``measured``: anything else (CPU, an unknown GPU, fp32 training): the achieved FLOP/s of a
  short square-matmul benchmark in the training dtype, so MFU then reads "fraction of what a big
  matmul reaches here", a real ceiling rather than a marketing one.
"""

from __future__ import annotations

import functools
import math
import re
import time

import torch

PEAK_FLOPS: dict[str, float] = {
    # Dense (not 2:4 sparse) bf16/fp16 tensor-core FLOP/s with fp32 accumulate, per GPU. NVIDIA's
    # datasheets print the sparse figure with an asterisk; the dense one is half of it.
    "B200": 2.25e15,  # HGX B200 datasheet: FP16/BF16 36 PFLOPS sparse for 8 GPUs -> 4.5 sparse, 2.25 dense each
    "H200 NVL": 835e12,  # H200 datasheet, NVL column: 1,671 TFLOPS sparse
    "H200": 989e12,  # H200 datasheet, SXM column: 1,979 TFLOPS sparse
    "H100 NVL": 835e12,  # H100 datasheet, NVL column: 1,671 TFLOPS sparse (per GPU)
    "H100 PCIe": 756e12,  # H100 datasheet, PCIe column: 1,513 TFLOPS sparse
    "H100": 989e12,  # H100 datasheet, SXM column: 1,979 TFLOPS sparse ("NVIDIA H100 80GB HBM3" is the SXM part)
    "H20": 148e12,  # H20 product brief: FP16/BF16 tensor 148 TFLOPS dense (296 sparse)
    "A100": 312e12,  # A100 datasheet: BF16/FP16 tensor 312 TFLOPS dense, all of 40/80 GB, SXM and PCIe
    # AWS's A10G has no NVIDIA datasheet of its own; NVIDIA's A10 datasheet gives 125 TFLOPS dense
    # (250 sparse). The A10G is clocked lower, so its MFU against this is a slight underestimate.
    "A10G": 125e12,
    "L40S": 362e12,  # L40S datasheet: BF16/FP16 tensor 362.05 TFLOPS dense (733 sparse)
    "L4": 121e12,  # L4 datasheet: BF16/FP16 tensor 242 TFLOPS sparse
    "RTX 4090": 165.2e12,  # Ada whitepaper (appendix A): FP16/BF16 tensor, fp32 accumulate, 165.2 dense (330.3 sparse)
    "MI300X": 1307.4e12,  # AMD Instinct MI300X datasheet: BF16/FP16 1307.4 TFLOPS dense (2614.9 with sparsity)
}
"""Known GPUs -> dense bf16/fp16 tensor-core peak FLOP/s per device."""

TABLE_DTYPES = (torch.bfloat16, torch.float16)
"""The table holds tensor-core peaks for these; other dtypes are measured (fp32/TF32 peaks are a
fraction of them, and whether TF32 is on is a runtime setting)."""

BENCH_SIZES = (256, 512, 1024)
BENCH_SECONDS = 0.25
"""Timed part of the benchmark; the warm-up adds about one matmul of each size."""


def peak_flops(device: str, override: float = 0.0, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(peak FLOP/s of one rank, where it came from: 'config', 'table:<name>' or 'measured').

    ``device`` is a torch device string ('cpu', 'cuda', 'cuda:1'); ``dtype`` the dtype the model's
    matmuls run in. The measurement is cached per (device, dtype, thread count): it runs once.
    """
    if override > 0:
        return float(override), "config"
    dev = torch.device(device)
    if dev.type == "cuda" and dtype in TABLE_DTYPES:
        name = match_device(torch.cuda.get_device_name(dev))
        if name is not None:
            return PEAK_FLOPS[name], f"table:{name}"
    return _measured(str(dev), dtype, torch.get_num_threads()), "measured"


def match_device(device_name: str) -> str | None:
    """The ``PEAK_FLOPS`` row for a device name such as 'NVIDIA H100 80GB HBM3', or None.

    Case-insensitive and whole-token, not a plain substring test: that would read an H200 as an
    H20 and an L40S as an L4. Longest row first, so 'H100 PCIe' wins over 'H100'.
    """
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        pattern = r"(?<![a-z0-9])" + re.escape(name.lower()).replace(r"\ ", r"[\s_-]*") + r"(?![a-z0-9])"
        if re.search(pattern, device_name.lower()):
            return name
    return None


@functools.lru_cache(maxsize=8)
def _measured(device: str, dtype: torch.dtype, threads: int) -> float:
    """Achieved FLOP/s of square matmuls on ``device`` (``threads`` is part of the cache key only:
    the benchmark uses torch's current thread count, as the training step does)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    mats = {n: (torch.randn(n, n, device=dev).to(dtype), torch.randn(n, n, device=dev).to(dtype)) for n in BENCH_SIZES}
    for a, b in mats.values():  # warm-up: first calls pick kernels and fault in pages
        torch.mm(a, b)
    sync()
    best = 0.0
    # The best rate of any size counts: small matmuls underrate a device (launch and cache effects),
    # so averaging them in would lower the peak and inflate MFU. Each size gets an equal share of time.
    for n, (a, b) in mats.items():
        flops, elapsed, deadline = 0.0, 0.0, time.perf_counter() + BENCH_SECONDS / len(BENCH_SIZES)
        start = time.perf_counter()
        while True:
            torch.mm(a, b)
            sync()
            flops += 2.0 * n**3
            elapsed = time.perf_counter() - start
            if time.perf_counter() >= deadline:
                break
        best = max(best, flops / elapsed)
    if not math.isfinite(best) or best <= 0:
        raise RuntimeError(f"matmul benchmark on {device} ({dtype}) measured {best} FLOP/s")
    return best
