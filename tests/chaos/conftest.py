"""One twin cache for every chaos test: scenarios of the same job reuse one fault-free twin."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def twin_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("chaos-twin-cache"))
