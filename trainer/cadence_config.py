"""Validation of the ``[checkpoint]`` cadence keys (``cadence``, ``memory_every_range``,
``persist_every_range``, ``mtbf_prior_s``, ``max_loss_s``; docs/cadence.md), kept beside the
cadence it configures so the section's own file stays about saving."""

from __future__ import annotations

from typing import Any

from resilient.errors import ConfigError
from resilient.validate import check_choice, check_int, check_number


def check_cadence(c: Any) -> None:
    """The cadence keys of a ``CheckpointConfig`` (``c``), each error naming its key; normalizes
    the ranges to lists of ints."""
    check_choice("checkpoint.cadence", c.cadence, ("fixed", "adaptive"))
    check_number("checkpoint.mtbf_prior_s", c.mtbf_prior_s, 1.0, 1e12)
    check_number("checkpoint.max_loss_s", c.max_loss_s, 0.0, 1e9)
    if c.max_loss_s and c.cadence != "adaptive":
        raise ConfigError(
            f"checkpoint.max_loss_s={c.max_loss_s} needs checkpoint.cadence='adaptive' (a fixed "
            "persist_every is the bound there): set cadence='adaptive' or drop max_loss_s"
        )
    for name, start in (("memory_every", c.memory_every), ("persist_every", c.persist_every)):
        key, bounds = f"checkpoint.{name}_range", getattr(c, f"{name}_range")
        if not isinstance(bounds, list | tuple) or len(bounds) != 2:
            raise ConfigError(f"{key}={bounds!r} must be [min, max] steps, e.g. [1, 1000]")
        check_int(f"{key}[0]", bounds[0], 1)
        check_int(f"{key}[1]", bounds[1], 1)
        if bounds[0] > bounds[1]:
            raise ConfigError(f"{key}={list(bounds)}: min is above max; swap them")
        if c.cadence == "adaptive" and start and not bounds[0] <= start <= bounds[1]:
            raise ConfigError(
                f"checkpoint.{name}={start} is outside {key}={list(bounds)}: the starting interval must lie "
                "within its range"
            )
        setattr(c, f"{name}_range", [int(bounds[0]), int(bounds[1])])
