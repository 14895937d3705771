"""Peak FLOP/s for MFU: the override wins, known GPUs come from the table, anything else is measured."""

from __future__ import annotations

import math

import pytest
import torch

from resilient.trainer import peak
from resilient.trainer.peak import PEAK_FLOPS, match_device, peak_flops


@pytest.mark.timeout(10)
def test_override_wins_everywhere(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cpu", override=123e12) == (123e12, "config")
    assert peak_flops("cuda", override=5e12, dtype=torch.bfloat16) == (5e12, "config")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("device_name", "row"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GeForce RTX 3060", None),
        ("Tesla T4", None),
        ("NVIDIA L40", None),  # not an L4: whole tokens only
    ],
)
def test_device_names_match_the_right_row(device_name: str, row: str | None) -> None:
    assert match_device(device_name) == row


@pytest.mark.timeout(10)
def test_table_values_are_dense_datasheet_numbers() -> None:
    assert PEAK_FLOPS["H100"] == 989e12 and PEAK_FLOPS["H100 PCIe"] == 756e12 and PEAK_FLOPS["A100"] == 312e12
    assert PEAK_FLOPS["H20"] == 148e12 and PEAK_FLOPS["MI300X"] == 1307.4e12 and PEAK_FLOPS["B200"] == 2.25e15
    assert all(1e13 < v < 1e16 for v in PEAK_FLOPS.values())


@pytest.mark.timeout(10)
def test_known_cuda_device_reads_the_table(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda:0", dtype=torch.bfloat16) == (989e12, "table:H100")
    assert peak_flops("cuda", dtype=torch.float16) == (989e12, "table:H100")


@pytest.mark.timeout(10)
def test_fp32_or_unknown_gpu_is_measured(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(peak, "_measured", lambda device, dtype, threads: calls.append((device, dtype)) or 7e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GeForce RTX 3060")
    assert peak_flops("cuda:1", dtype=torch.bfloat16) == (7e12, "measured")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda", dtype=torch.float32) == (7e12, "measured")  # the table is for bf16/fp16
    assert calls == [("cuda:1", torch.bfloat16), ("cuda", torch.float32)]


@pytest.mark.timeout(30)
def test_measured_on_cpu_is_plausible_and_cached(monkeypatch) -> None:
    peak._measured.cache_clear()
    flops, source = peak_flops("cpu")
    assert source == "measured"
    assert math.isfinite(flops) and 1e8 <= flops <= 1e13, flops
    # Cached: a second call runs no benchmark (counted, not timed: no wall-clock thresholds in tests).
    monkeypatch.setattr(torch, "mm", lambda *a, **k: pytest.fail("benchmarked again"))
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: pytest.fail("benchmarked again"))
    assert peak_flops("cpu") == (flops, "measured")
