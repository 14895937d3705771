"""Shared settings for the data-pipeline tests: small and fast on two CPU cores."""

from __future__ import annotations

import pytest

from resilient.trainer.data import DataConfig


@pytest.fixture
def small_config() -> DataConfig:
    """Short epochs (about 20 rows) so rollover and whole-epoch checks run in well under a second."""
    return DataConfig(seed=7, num_samples=60, global_rows=4, packing_window=16, num_workers=0)
