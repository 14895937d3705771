"""Where a DCP call points: our root URL and step, from the plugin's arguments or DCP's
``checkpoint_id``. torchtitan names a checkpoint ``<folder>/step-<N>`` and passes that path as
``checkpoint_id``; ``<folder>`` is then our root and N the step (``step-000000005``, as we name
step directories, reads the same)."""

from __future__ import annotations

import os
import re

from resilient.errors import ConfigError

_STEP = re.compile(r"^step-(\d+)$")


def split_step(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    """``<root>/step-<N>`` -> (root, N); anything else -> (it, None)."""
    text = os.fspath(checkpoint_id).rstrip("/")
    head, _, tail = text.rpartition("/")
    match = _STEP.match(tail)
    if match is None or not head:
        return text, None
    return head, int(match.group(1))


def resolve(url: str | None, step: int | None, checkpoint_id: str | os.PathLike | None) -> tuple[str, int | None]:
    """The (root, step) a call addresses: ``checkpoint_id`` (DCP's argument) over the plugin's own."""
    if checkpoint_id is not None:
        root, named = split_step(checkpoint_id)
        return root, named if named is not None else step
    if url is None:
        raise ConfigError(
            "resilient.dcp needs a checkpoint root: pass it to the plugin (StorageWriter(url, step=N)) "
            "or pass checkpoint_id='<root>/step-<N>' to dcp.save / dcp.load"
        )
    return url, step


def check_step(step: int | None, what: str) -> int:
    if step is None:
        raise ConfigError(
            f"{what} needs a step: pass StorageWriter(url, step=N), or checkpoint_id='<root>/step-<N>' to dcp.save"
        )
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    return step
