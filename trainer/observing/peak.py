"""The peak FLOP/s one rank can reach: the denominator of MFU.

MFU against a wrong peak is a wrong number that looks right (a CPU run "at 0.00001 % MFU" of an
H100's 989 TFLOP/s, or an H20 reported against H100 numbers). So the peak says where it came from:

- ``config``: the recipe's ``run.peak_flops`` override, when > 0;
- ``table:<name>``: a CUDA device whose name matches a row of ``PEAK_FLOPS`` (dense bf16/fp16
  tensor-core peak from the vendor's datasheet), when training in bf16/fp16;
- ``measured`` / ``cached``: anything else (CPU, an unknown GPU, fp32 training): the achieved
  FLOP/s of the model's own matmul shapes in the training dtype, so MFU then reads "fraction of
  what this model's matmuls reach here", a real ceiling rather than a marketing one. Measured once
  per machine and kept in a cache file (restarts compare against the same number), and raised
  whenever a step does better (``Peak.at_least``): a measured MFU is never above 100%.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from resilient.runfiles import read_json, write_json

if TYPE_CHECKING:
    from resilient.trainer.config import TrainConfig

log = logging.getLogger(__name__)
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

BENCH_SIZES = ((1024, 1024, 1024),)
"""The matmul shapes (m, k, n) measured when the caller names none (``model_matmul_shapes``)."""
BENCH_SECONDS = 0.25
"""Timed part of the benchmark; the warm-up adds about one matmul of each shape."""
MAX_BENCH_ROWS = 8192
"""Rows of a measured matmul at most: a longer one runs at the same rate and only takes longer."""
CACHE_ENV = "RESILIENT_PEAK_CACHE"
"""The per-machine peak cache file; default ``~/.cache/resilient/peak.json``."""

SURPRISE = 0.10
"""How far above a measured peak a step may go before the rise is logged as a warning."""

Shapes = tuple[tuple[int, int, int], ...]


@dataclass(slots=True)
class Peak:
    """The MFU denominator of one rank and where it came from (``source``: 'config',
    'table:<name>', 'measured' at this start, or 'cached' from an earlier start on this machine).

    A measured peak is a floor of what the machine does, not a ceiling: a busy moment at start
    makes it low. So a step whose model FLOP/s exceed it raises it (``at_least``), and the
    per-machine cache keeps the highest seen: MFU is never above 100%, and restarts on one machine
    compare against the same number."""

    flops: float
    source: str
    key: str = ""
    """The cache entry: device model, dtype, threads and matmul shapes."""
    cache_path: str = ""
    raised: bool = False
    """A step beat the peak this run: ``remember`` writes the new one to the cache."""

    def at_least(self, achieved: float) -> float:
        """The peak, raised to ``achieved`` FLOP/s when a measured one is below it, in memory (a
        write inside a step would cost the step; ``remember`` writes it once, at close). A vendor's
        table or the recipe's value is left alone. A step far above the measured peak is more
        likely a wrong FLOP count than a busy start: said, not hidden by the rising peak."""
        if achieved > self.flops and self.source in ("measured", "cached"):
            if achieved > self.flops * (1 + SURPRISE):
                log.warning(
                    "a step reached %.3g FLOP/s, more than %d%% above the %s peak %.3g: the peak "
                    "rises to it, but check the model's FLOP count if this machine was not busy at start",
                    achieved,
                    round(SURPRISE * 100),
                    self.source,
                    self.flops,
                )
            self.flops, self.raised = achieved, True
        return self.flops

    def remember(self) -> None:
        """Keep a peak a step raised in the per-machine cache (one rank, at the end of the run)."""
        if self.raised and self.cache_path:
            _remember(self.cache_path, self.key, self.flops)
            self.raised = False


def peak_flops(
    device: str, override: float = 0.0, dtype: torch.dtype = torch.float32, shapes: Shapes = BENCH_SIZES
) -> tuple[float, str]:
    """(peak FLOP/s of one rank, where it came from); see ``find_peak``."""
    peak = find_peak(device, override, dtype, shapes)
    return peak.flops, peak.source


def find_peak(
    device: str, override: float = 0.0, dtype: torch.dtype = torch.float32, shapes: Shapes = BENCH_SIZES
) -> Peak:
    """The peak of one rank: the recipe's ``run.peak_flops`` when > 0, the table for a known GPU in
    bf16/fp16, else the best rate of the model's own matmul ``shapes`` in ``dtype``, measured once
    per machine (cached in ``$RESILIENT_PEAK_CACHE``, keyed by the device's model, the dtype,
    torch's thread count and the shapes)."""
    if override > 0:
        return Peak(float(override), "config")
    dev = torch.device(device)
    if dev.type == "cuda" and dtype in TABLE_DTYPES:
        name = match_device(torch.cuda.get_device_name(dev))
        if name is not None:
            return Peak(PEAK_FLOPS[name], f"table:{name}")
    threads = torch.get_num_threads()
    key = f"{_device_model(dev)}|{str(dtype).removeprefix('torch.')}|threads={threads}|{shapes}"
    path = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "resilient", "peak.json")
    cached = (_read_cache(path)).get(key)
    if isinstance(cached, int | float) and math.isfinite(cached) and cached > 0:
        return Peak(float(cached), "cached", key, path)
    flops = _measured(str(dev), dtype, threads, shapes)
    _remember(path, key, flops)
    return Peak(flops, "measured", key, path)


def model_matmul_shapes(config: TrainConfig) -> Shapes:
    """The (m, k, n) of one rank's big matmuls in a step: its tokens (of a microbatch under
    pipelining) times the model width into the attention, MLP and output projections, each split
    over the tensor-parallel ranks."""
    p, model, data = config.parallel, config.model, config.data.pipeline
    rows = max(1, data.global_rows // p.dp_shard // (p.microbatches if p.pp > 1 else 1))
    m = min(MAX_BENCH_ROWS, rows * data.row_len)
    outs = sorted({model.dim, model.ffn_hidden_dim, model.vocab_size})
    return tuple((m, model.dim, max(1, n // p.tp)) for n in outs)


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


def _device_model(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'cpu'} x{os.cpu_count()}"


def _read_cache(path: str) -> dict:
    try:
        return read_json(path) or {}
    except (OSError, ValueError):
        return {}


def _remember(path: str, key: str, flops: float) -> None:
    """Keep the highest peak seen for ``key`` (best effort: a read-only home keeps none)."""
    known = _read_cache(path)
    try:
        if flops > float(known.get(key, 0.0)):
            write_json(path, {**known, key: flops})
    except (OSError, TypeError, ValueError):
        pass


def _measured(device: str, dtype: torch.dtype, threads: int, shapes: Shapes) -> float:
    """Achieved FLOP/s of matmuls of ``shapes`` on ``device`` (``threads`` is part of the cache key
    only: the benchmark uses torch's current thread count, as the training step does)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    mats = {
        (m, k, n): (torch.randn(m, k, device=dev).to(dtype), torch.randn(k, n, device=dev).to(dtype))
        for m, k, n in shapes
    }
    for a, b in mats.values():  # warm-up: first calls pick kernels and fault in pages
        torch.mm(a, b)
    sync()
    best = 0.0
    # The best rate of any shape counts: averaging slower ones in would lower the peak and inflate
    # MFU. Each shape gets an equal share of the time.
    for (m, k, n), (a, b) in mats.items():
        flops, elapsed, deadline = 0.0, 0.0, time.perf_counter() + BENCH_SECONDS / len(mats)
        start = time.perf_counter()
        while True:
            torch.mm(a, b)
            sync()
            flops += 2.0 * m * k * n
            elapsed = time.perf_counter() - start
            if time.perf_counter() >= deadline:
                break
        best = max(best, flops / elapsed)
    if not math.isfinite(best) or best <= 0:
        raise RuntimeError(f"matmul benchmark on {device} ({dtype}) measured {best} FLOP/s")
    return best
