"""Which machine a rank runs on: the identity its RAM snapshots are kept under.

A node of the RAM tier is a place whose memory outlives the worker processes (its tmpfs store).
Its identity must therefore name that place and stay the same when the job restarts, whatever
rank numbers the restart hands out. Resolved in this order, the first one set wins:

1. ``RESILIENT_NODE_ID``: the operator knows best (e.g. a Kubernetes node name from the downward
   API when the store is a hostPath, or two launchers on one machine playing two nodes);
2. ``POD_NAME``: a pod's name (set from the downward API), stable across container restarts,
   which is what keeps a pod's memory-backed ``emptyDir`` (a replaced pod has a new name, and an
   empty memory: it is a new node either way);
3. ``SLURMD_NODENAME``: the name of the SLURM node the step runs on;
4. ``socket.gethostname()``: the machine's host name (a pod's ``HOSTNAME`` too).

Deliberately NOT ``NODE_RANK``, ``GROUP_RANK`` or ``SLURM_NODEID``: they are positions in the
current rendezvous or allocation, and elastic rendezvous renumbers them across restarts, which is
the bug this module exists to avoid (snapshots kept under node 1 looked for under node 0).

``exchange`` shares every rank's identity with one small all-gather; the pairing is
then recomputed from the sorted distinct identities at every (re)start (``ram.pairing``).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Mapping

from resilient import dist as rdist

NODE_ID_ENV = "RESILIENT_NODE_ID"
SOURCES = (NODE_ID_ENV, "POD_NAME", "SLURMD_NODENAME")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME = 64


def resolve_node_id(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """This machine's identity and where it came from (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    for name in SOURCES:
        value = env.get(name, "").strip()
        if value:
            return value, name
    return socket.gethostname(), "hostname"


def exchange(identity: str) -> list[str]:
    """Every rank's ``identity``, in rank order (collective over the default group: one all-gather,
    bounded by the process group's timeout). A rank's local rank is its position among the ranks
    of its identity (``Pairing.ranks_on``), not torchrun's ``LOCAL_RANK``: the pairing and the
    snapshot indexes then use one numbering, whatever the launcher set."""
    return rdist.agree(lambda: identity, what="RAM tier node identities")


def sanitize(identity: str) -> str:
    """``identity`` as one safe path component. A name that had to change (other characters, too
    long) gets a hash of the original, so two distinct identities never share a directory."""
    safe = _SAFE.sub("_", identity)[:_MAX_NAME]
    if safe != identity or safe in ("", ".", ".."):
        safe = f"{safe}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"
    return safe
