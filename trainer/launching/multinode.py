"""torchrun's multi-node rendezvous for ``resilient-train``: ``--nnodes N`` (or elastic ``MIN:MAX``),
``--node-rank``, ``--rdzv-endpoint HOST:PORT``, ``--rdzv-id``.

Run the same command on every node; each launcher starts ``--nproc-per-node`` ranks and their
torchrun agents meet at the c10d rendezvous store on HOST:PORT (hosted by the launcher whose
machine is HOST). Always the c10d backend, never torchrun's static one: with c10d a node whose
launcher restarts (or a replacement node) joins again and every agent restarts its workers into the
new membership, which is what ``--max-restarts`` counts; a static rendezvous forms once.

Replica groups (``--replica-groups G``) spread over the nodes instead: node R runs groups R, R+N,
..., each a one-node torchrun; their rendezvous is the job's torchft lighthouse, which node 0 starts
on ``--rdzv-endpoint HOST:PORT`` unless ``--lighthouse URL`` names a running one.

Kept apart from ``launch`` (which runs the commands) and free of torch imports: the launcher checks
every flag in a second, before any worker starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

from resilient.errors import ConfigError
from resilient.runfiles import pids_dir
from resilient.trainer.observing.quiet import LAUNCH_ENV

NODE_RANK_ENV = "NODE_RANK"
"""Set for the ranks when ``--node-rank`` is given (torchrun's own ``GROUP_RANK`` may change at a
re-rendezvous). Never a node identity for the RAM tier: a requeue can give it to another machine
(``recovery/ram/node_id.py``)."""

MULTINODE_RESTARTS = 3
"""Default ``--max-restarts`` across nodes: a node that comes back (or its replacement) makes every
agent restart its workers into the new membership, and each such restart counts."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Rendezvous:
    """Where and as what this node's launcher joins the job."""

    min_nodes: int
    max_nodes: int
    endpoint: str
    """HOST:PORT of the c10d rendezvous store; the same on every node."""
    rdzv_id: str
    """The job's rendezvous id: the same on every node, new for each launch of the job."""
    node_rank: int | None = None
    launch_id: str = field(default_factory=lambda: f"{os.getpid()}x{int(time.time())}")
    """This launcher's own id (``LAUNCH_ENV``): the operator may reuse ``rdzv_id`` for a rerun."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"--nnodes {self.nnodes}: need 1 <= MIN <= MAX")
        if self.node_rank is not None and not 0 <= self.node_rank < self.max_nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} must be in [0, {self.max_nodes}) for --nnodes {self.nnodes}"
            )

    @property
    def nnodes(self) -> str:
        return str(self.min_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"

    def torchrun_args(self) -> list[str]:
        # No --node-rank: the c10d rendezvous ranks the nodes itself (torchrun warns that it ignores
        # it); the operator's node rank reaches the ranks as NODE_RANK instead (``env``).
        args = ["--nnodes", self.nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint]
        args += ["--rdzv-id", self.rdzv_id]
        if self.node_rank is not None:
            # Node 0 hosts the store. Otherwise torchrun guesses from HOST: every launcher whose
            # machine HOST names tries, the first to bind wins, and several launchers on one
            # machine race for it; the store dies with the winner, so which one won matters.
            args += ["--rdzv-conf", f"is_host={int(self.node_rank == 0)}"]
        return args

    def env(self) -> dict[str, str]:
        """Environment for this node's ranks."""
        env = {LAUNCH_ENV: self.launch_id}
        return env if self.node_rank is None else {**env, NODE_RANK_ENV: str(self.node_rank)}


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX); ConfigError naming the flag otherwise."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--nnodes {text!r} must be N or MIN:MAX (positive integers), e.g. --nnodes 2 or 2:4")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise ConfigError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    return low, high


def check_endpoint(text: str) -> str:
    """``HOST:PORT`` as given; ConfigError unless it has a host and a port in 1..65535."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--rdzv-endpoint {text!r} must be HOST:PORT with a port in 1..65535, e.g. node0:29400")
    return text


def flag_error(args: argparse.Namespace) -> str | None:
    """The first wrong combination of the multi-node flags, as one line (None when they fit).

    ``args``: ``nnodes``, ``node_rank``, ``rdzv_endpoint``, ``rdzv_id``, ``nproc``,
    ``nproc_per_node``, ``replica_groups``, as ``resilient-train`` parsed them."""
    multinode = [f for f, v in _given(args).items() if v is not None]
    if args.nnodes is None:
        if multinode:
            return f"{multinode[0]} takes --nnodes N (or MIN:MAX) as well"
        if args.nproc is not None and args.nproc_per_node is not None:
            return "on one node --nproc and --nproc-per-node are the same thing: give one"
        return None
    try:
        low, high = parse_nnodes(args.nnodes)
        if args.rdzv_endpoint is not None:
            check_endpoint(args.rdzv_endpoint)
    except ConfigError as e:
        return str(e)
    if args.replica_groups is not None:
        return _replica_flag_error(args, low, high)
    if args.rdzv_endpoint is None:
        return f"--nnodes {args.nnodes} takes --rdzv-endpoint HOST:PORT (the same on every node, e.g. node0:29400)"
    if args.rdzv_id is None:
        return f"--nnodes {args.nnodes} takes --rdzv-id ID, the same on every node and new for each launch"
    if args.node_rank is not None:
        if low != high:
            return f"elastic --nnodes {args.nnodes} ranks the nodes at each rendezvous: drop --node-rank"
        if not 0 <= args.node_rank < high:
            return f"--node-rank {args.node_rank} must be in [0, {high}) for --nnodes {args.nnodes}"
    return None


def _replica_flag_error(args: argparse.Namespace, low: int, high: int) -> str | None:
    """Replica groups over nodes: group g runs on node g % N, each group a one-node torchrun; the
    groups meet at the job's lighthouse (``--lighthouse URL``, or started by node 0 on
    ``--rdzv-endpoint HOST:PORT``), which is their rendezvous."""
    if low != high:
        return f"--replica-groups takes a fixed --nnodes N, not {args.nnodes}: a lost group drops out of the quorum"
    if high > args.replica_groups:
        return f"--nnodes {high} but --replica-groups {args.replica_groups}: every node runs at least one group"
    if args.node_rank is None:
        return f"--replica-groups with --nnodes {high} takes --node-rank R: node R runs groups R, R+{high}, ..."
    if not 0 <= args.node_rank < high:
        return f"--node-rank {args.node_rank} must be in [0, {high}) for --nnodes {high}"
    if args.rdzv_id is not None:
        return "--replica-groups takes no --rdzv-id: each group rendezvous on its own node"
    if args.rdzv_endpoint is None and not args.lighthouse:
        return "replica groups across nodes take --rdzv-endpoint HOST:PORT (node 0 starts a lighthouse) or --lighthouse"
    if args.rdzv_endpoint is not None and args.lighthouse:
        return "give --lighthouse URL (a running lighthouse) or --rdzv-endpoint HOST:PORT (node 0 starts one), not both"
    return None


def _given(args: argparse.Namespace) -> dict[str, object]:
    return {"--node-rank": args.node_rank, "--rdzv-endpoint": args.rdzv_endpoint, "--rdzv-id": args.rdzv_id}


def rendezvous_of(args: argparse.Namespace) -> Rendezvous | None:
    """The rendezvous the flags describe (``flag_error`` passed); None for a one-node launch."""
    if args.nnodes is None:
        return None
    low, high = parse_nnodes(args.nnodes)
    return Rendezvous(
        min_nodes=low, max_nodes=high, endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, node_rank=args.node_rank
    )


def split_ranks(world_size: int, max_nodes: int, nproc_per_node: int | None, nproc: int | None) -> int:
    """Ranks per node for a recipe of ``world_size`` (= parallel.pp x dp_shard x tp) ranks on
    ``max_nodes`` nodes: ``--nproc-per-node`` as given, or the recipe's ranks split evenly.
    ConfigError when the recipe, ``--nproc`` and ``--nproc-per-node`` disagree.

    An elastic job (``--nnodes MIN:MAX``) is sized for MAX nodes: the trainer checks that the ranks
    that met are pp x dp_shard x tp, so a rendezvous of fewer nodes stops with that one-line error."""
    fix = "set parallel.pp / parallel.dp_shard / parallel.tp so that their product is"
    if nproc is not None and nproc != world_size:
        raise ConfigError(
            f"--nproc {nproc} but parallel.pp x dp_shard x tp = {world_size} ranks: drop --nproc, or {fix} {nproc}"
        )
    if nproc_per_node is None:
        if world_size % max_nodes:
            raise ConfigError(
                f"parallel.pp x dp_shard x tp = {world_size} ranks do not split evenly over {max_nodes} nodes: "
                f"{fix} a multiple of {max_nodes}, or change --nnodes"
            )
        return world_size // max_nodes
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if nproc_per_node * max_nodes != world_size:
        raise ConfigError(
            f"--nnodes {max_nodes} x --nproc-per-node {nproc_per_node} = {nproc_per_node * max_nodes} ranks but "
            f"parallel.pp x dp_shard x tp = {world_size}: {fix} {nproc_per_node * max_nodes}, or drop --nproc-per-node"
        )
    return nproc_per_node


WAIT_REPORT_S = 5.0
"""How often a node that waits for the others at the rendezvous says so."""


class RendezvousWait:
    """Called while this node's torchrun runs (``torchrun.run``'s ``watch``): until torchrun starts
    its ranks (the rendezvous is complete: it starts them only then), says every
    ``WAIT_REPORT_S`` whom it waits for, where and since when. A node whose peers never come would
    otherwise sit silent until torchrun's join timeout (10 minutes)."""

    def __init__(self, rendezvous: Rendezvous, run_dir: str) -> None:
        self.rendezvous = rendezvous
        self.run_dir = run_dir
        self.since = time.time()
        self._next = self.since + WAIT_REPORT_S
        self.started = False

    def __call__(self, torchrun_pid: int = 0) -> bool:
        """Say so if still waiting; never asks to stop torchrun (returns False)."""
        if self.started:
            return False
        self.started = self._ranks_started(torchrun_pid)
        now = time.time()
        if self.started or now < self._next:
            return False
        self._next = now + WAIT_REPORT_S
        r = self.rendezvous
        others = f"{r.max_nodes - 1} other node(s)" if r.min_nodes == r.max_nodes else f"{r.min_nodes}+ nodes in all"
        print(
            f"waiting for {others} of --nnodes {r.nnodes} to join the rendezvous at {r.endpoint} (--rdzv-id "
            f"{r.rdzv_id}) since {time.strftime('%H:%M:%S', time.localtime(self.since))} ({now - self.since:.0f} s): "
            "start the same command on each of them",
            file=sys.stderr,
            flush=True,
        )
        return False

    def _ranks_started(self, torchrun_pid: int) -> bool:
        """torchrun started its ranks (it does once the rendezvous is complete): it has children,
        or (where /proc does not list them) a rank of this launch wrote its pid file."""
        if torchrun_pid and _has_children(torchrun_pid):
            return True
        folder = pids_dir(self.run_dir)
        try:
            names = os.listdir(folder)
        except OSError:
            return False
        return any(
            name.startswith("group") and ".tmp" not in name and _mtime(os.path.join(folder, name)) >= self.since - 1.0
            for name in names
        )


def _has_children(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                if f.read().strip():
                    return True
        except OSError:
            continue
    return False


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
