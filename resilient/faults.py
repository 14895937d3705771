"""Named fault points that tests and ``resilient-chaos`` use to pause or kill a process mid-save.

Off unless ``RESILIENT_FAULTS`` is set, e.g. ``persist.first_region_issued=pause:30@rank1``:
at that point, rank 1 writes ``<RESILIENT_FAULTS_DIR>/<point>.rank1`` (so a test knows it got
there) and sleeps 30 s, long enough to be SIGKILLed mid-write. Actions: ``pause:SECONDS``,
``raise`` (an OSError, as a failing disk would), ``enospc`` (the OSError of a full disk), ``exit``
(os._exit(43), a crash). ``@group1`` (or ``@group1rank0``) limits a fault to replica group 1
(``RESILIENT_GROUP``): every group has a rank 0.
"""

from __future__ import annotations

import errno
import os
import time


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _targets() -> tuple[str, ...]:
    rank, group = f"rank{_rank()}", f"group{os.environ.get('RESILIENT_GROUP', '0')}"
    return (rank, group, group + rank)


def _matching(point: str) -> str | None:
    spec = os.environ.get("RESILIENT_FAULTS", "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, action = item.partition("=")
        action, _, who = action.partition("@")
        if name == point and (not who or who in _targets()):
            return action
    return None


def fault_point(point: str) -> None:
    action = _matching(point) if "RESILIENT_FAULTS" in os.environ else None
    if action is None:
        return
    marker_dir = os.environ.get("RESILIENT_FAULTS_DIR")
    if marker_dir:
        os.makedirs(marker_dir, exist_ok=True)
        with open(os.path.join(marker_dir, f"{point}.rank{_rank()}"), "w") as f:
            f.write(str(os.getpid()))
    kind, _, arg = action.partition(":")
    if kind == "pause":
        time.sleep(float(arg or 3600))
    elif kind == "raise":
        raise OSError(f"injected fault at {point} on rank {_rank()}")
    elif kind == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point} on rank {_rank()})")
    elif kind == "exit":
        os._exit(43)
