"""``resilient-train --emit slurm|k8s``: the files that run one recipe across N nodes.

Both start one ``resilient-train`` per node with the multi-node rendezvous flags
(``resilient.trainer.launching.multinode``): the rendezvous store on the first node, node identity for the RAM
tier (``RESILIENT_NODE_ID``), ``/dev/shm`` big enough for the RAM tier's snapshots, and a restart
policy. Plain text built by small functions: every line of the output is visible here.

Kubernetes: a JobSet (``jobset.x-k8s.io``), not Kubeflow's PyTorchJob. JobSet is the Kubernetes
SIG Apps API for multi-node training, what Kubeflow Trainer v2 (TrainJob) and Kueue's multi-node
admission build on, and needs no framework operator: it gives indexed pods with stable DNS names
(rendezvous address, node rank, node identity) and a whole-set restart policy, and leaves process
launching to us. A PyTorchJob (Kubeflow training-operator v1, superseded by Trainer v2) would inject
its own torchrun environment (``PET_*``, ``MASTER_ADDR``) around a launcher that already does the
rendezvous.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
from dataclasses import dataclass, field

from resilient.errors import ConfigError
from resilient.trainer.launching.multinode import parse_nnodes
from resilient.trainer.preempt import SHUTDOWN_MARGIN_S

EMIT_KINDS = ("slurm", "k8s")
DEFAULT_SHM = "64Gi"
DEFAULT_RDZV_PORT = 29400
SHM_SIZE = re.compile(r"^([1-9][0-9]*)(Ki|Mi|Gi|Ti)$")
TIME_LIMIT = re.compile(r"^([0-9]+-)?[0-9]{1,2}:[0-9]{2}:[0-9]{2}$")
CPUS_PER_RANK = 8
"""A rank's main thread, its loader workers and the checkpoint writer's threads."""
MEM_PER_RANK_GI = 16
JOB_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
"""A DNS label short enough for the pod hostnames JobSet derives from it (``<name>-node-0-<i>``)."""
CLAIM_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
RUN_MOUNT = "/resilient/runs"
"""k8s: where every pod mounts ``--run-volume``; the job's run.dir is ``RUN_MOUNT/<job name>``."""
NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run")


@dataclass(kw_only=True, slots=True)
class EmitSpec:
    """One recipe on N nodes: what both generators need."""

    job_name: str = "resilient"
    min_nodes: int = 2
    max_nodes: int = 2
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    """GPUs to request per node; 0 for a CPU recipe (no GPU request)."""
    image: str = ""
    """k8s: the container image (``--image``, required there)."""
    shm_size: str = DEFAULT_SHM
    """Kubernetes quantity (``64Gi``): the RAM tier's ``/dev/shm`` per node."""
    rdzv_port: int = DEFAULT_RDZV_PORT
    max_restarts: int = 3
    trainer_args: list[str] = field(default_factory=list)
    """``--config`` / ``--set`` arguments every node passes on to its ranks."""
    time_limit: str = "24:00:00"
    """SLURM ``--time``: the preemption signal is asked for ahead of it."""
    cpus_per_node: int = 0
    """CPUs for one node's launcher and ranks (SLURM ``--cpus-per-task``, the pod's cpu request);
    0: ``CPUS_PER_RANK`` per rank."""
    mem_per_node: str = ""
    """Memory of one node as a Kubernetes quantity (the pod's request and limit, SLURM ``--mem``);
    empty: Kubernetes ``/dev/shm`` plus ``MEM_PER_RANK`` per rank, SLURM the whole node (``--mem=0``,
    the job is ``--exclusive``)."""
    preempt_grace_s: float = 120.0
    """``run.preempt_grace_s`` of the recipe: the time a preempted job needs to save and exit."""
    preempt_signal: str = "SIGUSR1"
    """SLURM: the signal asked for ahead of the time limit (``run.preempt_signal``, set on every node)."""
    replica_groups: int = 0
    """0: one group across all nodes. G: G torchft replica groups, G / nodes on each node, meeting at
    the lighthouse node 0 starts on ``rdzv_port`` (``resilient.trainer.launching.multinode``)."""
    nproc_per_group: int = 0
    run_dir: str = "runs/resilient"
    """The recipe's ``run.dir`` (job record, events, the group's timeline): SLURM nodes check that
    they all see the one the batch shell wrote into before they start."""
    run_volume: str = ""
    """k8s (required there): a ReadWriteMany PersistentVolumeClaim every pod mounts at ``RUN_MOUNT``."""

    def __post_init__(self) -> None:
        if not JOB_NAME.match(self.job_name):
            raise ConfigError(
                f"--job-name {self.job_name!r} must be a lowercase DNS label of at most 40 characters "
                "(letters, digits, '-'; starting with a letter): Kubernetes builds pod hostnames from it"
            )
        if not SHM_SIZE.match(self.shm_size):
            raise ConfigError(f"--shm-size {self.shm_size!r} must be a number with Ki, Mi, Gi or Ti, e.g. 64Gi")
        if not 1 <= self.rdzv_port <= 65535:
            raise ConfigError(f"--rdzv-port {self.rdzv_port} must be in 1..65535")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node} must be >= 0 (0: a CPU recipe)")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be >= 0")
        if not TIME_LIMIT.match(self.time_limit):
            raise ConfigError(f"--time {self.time_limit!r} must be [DAYS-]HH:MM:SS, e.g. 24:00:00 or 2-00:00:00")
        if self.cpus_per_node < 0:
            raise ConfigError(f"--cpus-per-node {self.cpus_per_node} must be >= 1 (0: {CPUS_PER_RANK} per rank)")
        if self.mem_per_node and not SHM_SIZE.match(self.mem_per_node):
            raise ConfigError(
                f"--mem-per-node {self.mem_per_node!r} must be a number with Ki, Mi, Gi or Ti, e.g. 256Gi"
            )
        if self.run_volume and not CLAIM_NAME.match(self.run_volume):
            raise ConfigError(
                f"--run-volume {self.run_volume!r} must be a PersistentVolumeClaim name (lowercase, '-', '.')"
            )
        if self.replica_groups and (self.elastic or self.replica_groups % self.max_nodes):
            raise ConfigError(
                f"--replica-groups {self.replica_groups} over --nnodes {self.nnodes}: the emitted nodes are alike, "
                "so give a fixed node count that divides the groups"
            )

    @property
    def nnodes(self) -> str:
        return str(self.max_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def cpus(self) -> int:
        return self.cpus_per_node or CPUS_PER_RANK * self.nproc_per_node

    @property
    def memory(self) -> str:
        """The pod's memory: ``/dev/shm`` (it counts against it) and room for every rank."""
        return (
            self.mem_per_node
            or f"{-(-kibibytes(self.shm_size) // (1 << 20)) + MEM_PER_RANK_GI * self.nproc_per_node}Gi"
        )


def emit_flag_error(args: argparse.Namespace) -> str | None:
    """The first flag that does not fit ``--emit`` (one line), None when they all do."""
    if args.config is None:
        return "--emit takes --config RECIPE (a path the nodes can read): the job runs that recipe"
    for flag, value in (
        ("--node-rank", args.node_rank),
        ("--rdzv-endpoint", args.rdzv_endpoint),
        ("--rdzv-id", args.rdzv_id),
    ):
        if value is not None:
            return f"--emit writes {flag} for each node itself: drop {flag}"
    for flag, value, default in (
        ("--lighthouse", args.lighthouse, ""),
        ("--join-timeout-ms", args.join_timeout_ms, 2000),
        ("--heartbeat-timeout-ms", args.heartbeat_timeout_ms, 2000),
        ("--grace-s", args.grace_s, 30.0),
    ):
        if value != default:
            return f"--emit does not write {flag} into the job file: drop it (or edit the emitted file)"
    for word in [args.config, *args.overrides]:
        if any(ord(c) < 32 or ord(c) == 127 for c in word):
            return f"--emit: {word!r} holds a control character (a newline would break the job file): drop it"
    if args.emit == "slurm" and args.run_volume:
        return "--run-volume is for --emit k8s; a SLURM job's run.dir is a path every node mounts: drop it"
    if args.emit == "k8s" and any(o.partition("=")[0].strip() == "run.dir" for o in args.overrides):
        return f"--emit k8s mounts --run-volume at {RUN_MOUNT}, run.dir={RUN_MOUNT}/{args.job_name}: drop --set run.dir"
    if args.emit == "k8s" and not args.image:
        return "--emit k8s takes --image IMAGE (a container image with resilient installed): the pods run it"
    if args.replica_groups is not None and args.nproc_per_node is not None:
        return "--replica-groups takes --nproc-per-group N (ranks per group), not --nproc-per-node"
    if args.nnodes is not None:
        try:
            parse_nnodes(args.nnodes)
        except ConfigError as e:
            return str(e)
    return None


def shutdown_s(spec: EmitSpec) -> int:
    """Seconds from a stop signal until every launcher on a node has exited: the grace the trainer
    saves in, torchrun's margin after it, and the launcher's own (``trainer.preempt``)."""
    return math.ceil(spec.preempt_grace_s + SHUTDOWN_MARGIN_S + 10.0)


def check_k8s_root(url: str) -> None:
    """A JobSet's checkpoints must outlive its pods and be one place for all of them: a path is
    each pod's own disk, gone with the pod (and no pod sees another's: the first save hangs)."""
    if not url.startswith("s3://"):
        raise ConfigError(
            f"--emit k8s: checkpoint.url={url} is a path inside each pod, lost with it and seen by no other "
            "pod: set checkpoint.url=s3://BUCKET/PREFIX"
        )


def check_slurm_run_dir(run_dir: str) -> None:
    """run.dir holds what every node's ranks must share (the job record, the group's timeline):
    a path under a node-local root is refused here; the script checks any other on every node."""
    path = os.path.normpath(run_dir)
    local = next((root for root in NODE_LOCAL if path == root or path.startswith(root + "/")), None)
    if local is not None:
        raise ConfigError(
            f"--emit slurm: run.dir={run_dir} is under {local}, each node's own: set run.dir to a path on a "
            "file system every node mounts (e.g. --set run.dir=$HOME/runs/JOB)"
        )


def check_k8s_run_volume(spec: EmitSpec) -> None:
    """A pod's own run.dir is lost when it restarts and seen by no other pod."""
    if not spec.run_volume:
        raise ConfigError(
            "--emit k8s: run.dir would be inside each pod, lost when it restarts and seen by no other pod: give "
            f"--run-volume CLAIM, a ReadWriteMany PersistentVolumeClaim (run.dir is then {RUN_MOUNT}/{spec.job_name})"
        )


def node_command(spec: EmitSpec, node_rank: str, endpoint: str, rdzv_id: str, extra: tuple[str, ...] = ()) -> str:
    """The ``resilient-train`` line one node runs; the three strings are shell words (``"$VAR"``);
    ``extra``: more trainer arguments, after the recipe's."""
    if spec.replica_groups:  # each group rendezvous on its own node: no --rdzv-id
        words = ["resilient-train", "--replica-groups", str(spec.replica_groups)]
        words += ["--nproc-per-group", str(spec.nproc_per_group), "--nnodes", spec.nnodes]
        flags = ["--node-rank", node_rank, "--rdzv-endpoint", endpoint]
    else:
        words = ["resilient-train", "--nnodes", spec.nnodes, "--nproc-per-node", str(spec.nproc_per_node)]
        flags = ["--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
        flags += [] if spec.elastic else ["--node-rank", node_rank]
    tail = ["--max-restarts", str(spec.max_restarts), *spec.trainer_args, *extra]
    return " ".join([*(shlex.quote(w) for w in words), *flags, *(shlex.quote(w) for w in tail)])


def meeting_point(spec: EmitSpec) -> str:
    """What the nodes meet at: the first node hosts it."""
    return "job's torchft lighthouse" if spec.replica_groups else "c10d rendezvous store"


def kibibytes(quantity: str) -> int:
    """A Kubernetes-style quantity (``SHM_SIZE``: 64Gi, 512Mi) in KiB."""
    number, unit = SHM_SIZE.match(quantity).groups()
    return int(number) * {"Ki": 1, "Mi": 1 << 10, "Gi": 1 << 20, "Ti": 1 << 30}[unit]
