"""benchmarks/pp_bench.py's arithmetic, without running it (a ``--quick`` run takes ~1.5 min of
torchrun jobs here: run it by hand, ``.venv/bin/python benchmarks/pp_bench.py --quick``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pp_bench  # noqa: E402  (the benchmarks folder is not a package)


@pytest.mark.timeout(10)
def test_theoretical_bubble() -> None:
    assert pp_bench.bubble_theory(2, 4, 1) == pytest.approx(1 / 5)  # 1F1B: (p-1)/(M+p-1)
    assert pp_bench.bubble_theory(2, 4, 2) == pytest.approx(1 / 9)  # interleaved: (p-1)/(vM+p-1)
    assert pp_bench.bubble_theory(4, 8, 1) == pytest.approx(3 / 11)
