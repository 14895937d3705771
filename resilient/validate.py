"""Config checks, written once: every message names the key, the value and what is allowed.

Config dataclasses call these from ``__post_init__`` with the key as a user writes it
(``"checkpoint.persist_every"``, ``"recovery.replication_bytes_per_s"``, ``"DataConfig.row_len"``),
so a bad value from a TOML file, a ``--set`` override or Python code fails with one line that
says which key to fix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

from resilient.errors import ConfigError


def check_int(key: str, value: object, low: int, high: int | None = None) -> int:
    """An integer (not a bool; numpy integers count) in ``[low, high]`` (``>= low`` when ``high`` is
    None), returned as a Python int."""
    allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{key}={value!r} must be an integer {allowed}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{key}={value} is out of range: allowed {allowed}")
    return int(value)


def check_number(
    key: str, value: object, low: float, high: float = math.inf, *, open_low: bool = False, unit: str = ""
) -> float:
    """A finite int or float in ``[low, high]`` (``(low, high]`` with ``open_low``)."""
    allowed = f"{'(' if open_low else '['}{low}, {high}]" + (f" {unit}" if unit else "")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number in {allowed}")
    if value < low or value > high or (open_low and value == low):
        raise ConfigError(f"{key}={value} is out of range: allowed {allowed}")
    return value


def check_choice(key: str, value: object, choices: Iterable[str]) -> str:
    """One of ``choices`` (compared as given: no case folding)."""
    allowed = list(choices)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} must be one of {', '.join(map(repr, allowed))}")
    return value  # type: ignore[return-value]


def check_bool(key: str, value: object) -> bool:
    """A real bool: ``1`` or ``"true"`` are rejected (a TOML typo must not flip a switch)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    return value
