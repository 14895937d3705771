"""Shared settings for the data-pipeline tests: small and fast on two CPU cores."""

from __future__ import annotations

import pytest

from resilient.trainer.data import DataConfig


@pytest.fixture
def small_config() -> DataConfig:
    """Epochs of 21 rows: a 4-row global batch straddles each epoch end, and whole epochs take
    well under a second."""
    return DataConfig(seed=7, num_samples=51, global_rows=4, packing_window=16, num_workers=0)
