"""Peak FLOP/s for MFU: the override wins, known GPUs come from the table, anything else is measured."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from resilient.trainer.observing import peak
from resilient.trainer.observing.peak import PEAK_FLOPS, Peak, find_peak, match_device, model_matmul_shapes, peak_flops


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own per-machine cache file (never the user's)."""
    monkeypatch.setenv(peak.CACHE_ENV, str(tmp_path / "peak.json"))


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
    monkeypatch.setattr(peak, "_measured", lambda device, dtype, threads, shapes: calls.append((device, dtype)) or 7e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GeForce RTX 3060")
    assert peak_flops("cuda:1", dtype=torch.bfloat16) == (7e12, "measured")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda", dtype=torch.float32) == (7e12, "measured")  # the table is for bf16/fp16
    assert calls == [("cuda:1", torch.bfloat16), ("cuda", torch.float32)]


@pytest.mark.timeout(30)
def test_measured_on_cpu_is_plausible_and_cached_per_machine(monkeypatch) -> None:
    flops, source = peak_flops("cpu", shapes=((64, 128, 256),))
    assert source == "measured"
    assert math.isfinite(flops) and 1e6 <= flops <= 1e13, flops
    # Cached on disk: the next start on this machine runs no benchmark and compares against the
    # same number (counted, not timed: no wall-clock thresholds in tests).
    monkeypatch.setattr(torch, "mm", lambda *a, **k: pytest.fail("benchmarked again"))
    again = find_peak("cpu", shapes=((64, 128, 256),))
    assert (again.flops, again.source) == (flops, "cached") and "float32|threads=" in again.key


@pytest.mark.timeout(30)
def test_the_model_s_own_shapes_are_measured() -> None:
    from resilient.trainer.config import load_config

    config = load_config("configs/tiny.toml", ["parallel.tp=2", "parallel.dp_shard=2"])
    shapes = model_matmul_shapes(config)
    rows = config.data.pipeline.global_rows // 2 * config.data.pipeline.row_len
    model = config.model
    assert shapes == tuple(
        (rows, model.dim, n // 2) for n in sorted({model.dim, model.ffn_hidden_dim, model.vocab_size})
    )


@pytest.mark.timeout(10)
def test_a_measured_peak_rises_to_what_a_step_achieves_so_mfu_stays_at_most_one(tmp_path) -> None:
    cache = str(tmp_path / "p.json")
    measured = Peak(10e9, "measured", "cpu-x|float32", cache)
    assert measured.at_least(8e9) == 10e9  # below the peak: MFU 0.8
    assert measured.at_least(25e9) == 25e9  # a busy start measured too low: MFU 1.0
    from resilient.runfiles import read_json

    assert not os.path.exists(cache)  # in memory during the run: no file write inside a step
    measured.remember()  # at close
    assert read_json(cache) == {"cpu-x|float32": 25e9}  # the next start begins from it
    for fixed in (Peak(10e9, "config"), Peak(989e12, "table:H100")):
        assert fixed.at_least(25e9) == fixed.flops  # not ours to change


@pytest.mark.timeout(10)
def test_a_step_far_above_a_measured_peak_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    # A wrong FLOP count would otherwise vanish into a peak that rises to it (MFU 1.0).
    measured = Peak(10e9, "measured")
    with caplog.at_level(logging.WARNING, logger="resilient.trainer.observing.peak"):
        assert measured.at_least(10.5e9) == 10.5e9  # within 10%: a busy start, quietly
        assert caplog.records == []
        assert measured.at_least(20e9) == 20e9
    (record,) = caplog.records
    assert "2e+10 FLOP/s" in record.getMessage() and "FLOP count" in record.getMessage()
