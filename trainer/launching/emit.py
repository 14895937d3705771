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
import json
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
            or f"{-(-_kibibytes(self.shm_size) // (1 << 20)) + MEM_PER_RANK_GI * self.nproc_per_node}Gi"
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


# -- SLURM -----------------------------------------------------------------------------------


def _kibibytes(quantity: str) -> int:
    number, unit = SHM_SIZE.match(quantity).groups()
    return int(number) * {"Ki": 1, "Mi": 1 << 10, "Gi": 1 << 20, "Ti": 1 << 30}[unit]


def _slurm_header(spec: EmitSpec) -> list[str]:
    nodes = str(spec.max_nodes) if not spec.elastic else f"{spec.min_nodes}-{spec.max_nodes}"
    lines = [
        "#!/bin/bash",
        f"# resilient: one recipe on {spec.nnodes} nodes x {spec.nproc_per_node} ranks (resilient-train --emit slurm).",
        "# Submit with: sbatch THIS_FILE",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",  # one launcher per node; it starts the node's ranks
        # Without it srun binds the launcher, and every rank it starts, to one CPU.
        f"#SBATCH --cpus-per-task={spec.cpus}",
        f"#SBATCH --time={spec.time_limit}",
        f"#SBATCH --mem={_kibibytes(spec.mem_per_node) // 1024}M" if spec.mem_per_node else "#SBATCH --mem=0",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    return lines + [
        "#SBATCH --exclusive",
        # Restart policy: a worker that fails is restarted by its node's torchrun (--max-restarts);
        # a lost node makes SLURM requeue the job (same job id, SLURM_RESTART_COUNT + 1), which
        # resumes from the newest step every rank has (RAM tier on surviving nodes, else storage).
        "#SBATCH --requeue",
        # Preemption ahead of the time limit: the batch shell gets the signal this long before it,
        # passes it to the job step, and every rank saves its step and exits 143; then the job is
        # requeued and resumes there (see the end of the script).
        f"#SBATCH --signal=B:{spec.preempt_signal.removeprefix('SIG')}@{shutdown_s(spec) + 30}",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=%x-%j.out",
        "",
        "set -euo pipefail",
    ]


def _slurm_node_script(spec: EmitSpec) -> str:
    need = _kibibytes(spec.shm_size)
    preempt = ("--set", f"run.preempt_signal={spec.preempt_signal}")
    command = node_command(spec, '"$SLURM_NODEID"', '"$RDZV_ENDPOINT"', '"$RDZV_ID"', preempt)
    return "\n".join(
        [
            # The machine's name, not SLURM_NODEID: that is a position in the allocation, and a
            # requeue onto other hosts would give a node another node's snapshots' directory.
            'export RESILIENT_NODE_ID="${RESILIENT_NODE_ID:-${SLURMD_NODENAME:-$(hostname)}}"',
            'shm_kib=$(df -P -k /dev/shm | tail -n 1 | tr -s " " | cut -d " " -f 2)',
            f'if [ "$shm_kib" -lt {need} ]; then',
            f'  echo "warning: /dev/shm on $(hostname) has $shm_kib KiB, the RAM tier wants {spec.shm_size}" >&2',
            "fi",
            'if [ ! -e "$RUN_DIR_MARK" ]; then',
            '  echo "error: run.dir $RUN_DIR on $(hostname) is not the one the first node wrote: put run.dir on'
            ' a file system every node mounts (--set run.dir=PATH)" >&2',
            "  exit 2",
            "fi",
            f"exec {command}",
        ]
    )


def slurm_script(spec: EmitSpec) -> str:
    """An sbatch script: ``srun`` starts one ``resilient-train`` per node, all meeting on the first."""
    lines = _slurm_header(spec) + [
        "",
        f"# The {_meeting_point(spec)} lives on the allocation's first node.",
        # sed, not head: head would exit early and pipefail would fail on the writer's SIGPIPE.
        'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f'export RDZV_ENDPOINT="$RDZV_HOST:{spec.rdzv_port}"',
        "# The same on every node, new for each (re)queued run of the job.",
        'export RDZV_ID="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"',
        *_slurm_job_secret(),
        "# run.dir (job record, events, the group's timeline) is one place for every node: each node",
        "# looks for this file before it starts (a node-local run.dir would not have it).",
        f"export RUN_DIR={shlex.quote(spec.run_dir)}",
        'export RUN_DIR_MARK="$RUN_DIR/.nodes-see-$RDZV_ID"',
        'mkdir -p "$RUN_DIR" && : > "$RUN_DIR_MARK"',
        "",
        "# The RAM tier keeps its snapshots in /dev/shm, a tmpfs SLURM does not size: it is the node's",
        "# (by default half its RAM) and counts against the job's memory. Each node warns if its",
        f"# /dev/shm is smaller than --shm-size {spec.shm_size}; set recovery.store_dir to use another tmpfs.",
        # kill-on-bad-exit: a node whose launcher gave up must not leave the others waiting in a
        # rendezvous that can no longer complete.
        # Replica groups: 0, the other nodes' groups train on without the lost ones.
        f"srun --ntasks-per-node=1 --kill-on-bad-exit={0 if spec.replica_groups else 1} "
        f"bash -c {shlex.quote(_slurm_node_script(spec))} &",
        *_slurm_preemption(spec),
        "",
    ]
    return "\n".join(lines)


def _slurm_preemption(spec: EmitSpec) -> list[str]:
    """The batch shell waits for the job step in the background, so that the signal SLURM sends it
    ahead of the time limit runs the trap at once (a foreground srun would hold it until the step
    ends): the trap passes it to srun, which passes it to every node's launcher. A step that then
    exits 143 (preempted, its last step saved) requeues the job: it resumes from that step."""
    name = spec.preempt_signal.removeprefix("SIG")
    return [
        "step_pid=$!",
        "preempted=0",
        f"trap 'preempted=1; woke=1; kill -{name} \"$step_pid\" 2>/dev/null || true' {name}",
        *(_slurm_term_trap() if name != "TERM" else []),
        "# wait returns early when the trap runs: wait again (127: the step's status was taken already).",
        "code=0",
        "woke=1",
        'while [ "$woke" = 1 ]; do',
        "  woke=0",
        '  if wait "$step_pid"; then code=0; else status=$?; [ "$status" = 127 ] || code=$status; fi',
        "done",
        'rm -f "$RUN_DIR_MARK"',
        'if [ "$preempted" = 1 ] && [ "$code" = 143 ]; then',
        '  echo "preempted: the last step is saved; requeueing job $SLURM_JOB_ID" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
    ]


def _slurm_term_trap() -> list[str]:
    """SLURM stops a job (scancel, preemption, the time limit) with SIGTERM to the batch shell too,
    then SIGKILL after ``KillWait``: bash would die at once and leave the step unwaited for. Pass it
    on and wait the same way, without a requeue (SLURM requeues a preempted job itself)."""
    return ["trap 'woke=1; kill -TERM \"$step_pid\" 2>/dev/null || true' TERM"]


def _meeting_point(spec: EmitSpec) -> str:
    return "job's torchft lighthouse" if spec.replica_groups else "c10d rendezvous store"


# -- the job's secret (recovery/channel/secret.py; README "Security") --------------------------------


def _slurm_job_secret() -> list[str]:
    """Every node's ranks share one secret (srun passes the environment on), made once per run of
    the script unless the operator exported one: else each node would make its own job.key."""
    return [
        "# One job secret for every node (it keys buddy copies, heals and quorum membership).",
        'export RESILIENT_JOB_SECRET="${RESILIENT_JOB_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d " \\n")}"',
    ]


def _k8s_job_secret(spec: EmitSpec) -> list[str]:
    """Every pod takes the job secret from one Secret (a pod without it would make its own
    job.key, and heals across pods would be refused); a pod does not start until it exists."""
    name = f"{spec.job_name}-job-secret"
    return [
        f"              # Create once: kubectl create secret generic {name} \\",
        "              #   --from-literal=secret=$(openssl rand -hex 32)",
        "              - name: RESILIENT_JOB_SECRET",
        "                valueFrom:",
        "                  secretKeyRef:",
        f"                    name: {name}",
        "                    key: secret",
        "              - name: RESILIENT_JOB_ID  # a restarted set is the same job (recovery.ownership)",
        f"                value: {_q(spec.job_name)}",
    ]


# -- Kubernetes (JobSet) ---------------------------------------------------------------------


def _q(value: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(value)


def _k8s_container(spec: EmitSpec, endpoint: str) -> list[str]:
    run_dir = ("--set", f"run.dir={RUN_MOUNT}/{spec.job_name}")  # on --run-volume, after the recipe's
    command = node_command(spec, '"$JOB_COMPLETION_INDEX"', f'"{endpoint}"', '"$RDZV_ID"', run_dir)
    lines = [
        "            containers:",
        "            - name: trainer",
        f"              image: {_q(spec.image)}",
        '              command: ["bash", "-c"]',
        "              args:",
        "              - |",
        # The pod's hostname <name>-node-0-<i>: the stable part of its name, kept by a replacement pod.
        '                export RESILIENT_NODE_ID="${RESILIENT_NODE_ID:-$(hostname)}"',
        f"                exec {command}",
        "              ports:",
        f"              - containerPort: {spec.rdzv_port}",
        "              env:",
        "              # JOB_COMPLETION_INDEX (the node rank) is set by the Indexed Job itself.",
        "              - name: RESTART_ATTEMPT",
        "                valueFrom:",
        "                  fieldRef:",
        "                    fieldPath: metadata.annotations['jobset.sigs.k8s.io/restart-attempt']",
        "              - name: RDZV_ID",
        f"                value: {_q(spec.job_name + '-$(RESTART_ATTEMPT)')}",
        "              - name: PYTHONUNBUFFERED",
        '                value: "1"',
        *_k8s_job_secret(spec),
        "              volumeMounts:",
        "              - name: dshm",
        "                mountPath: /dev/shm",
        "              - name: runs",
        f"                mountPath: {RUN_MOUNT}",
    ]
    gpus = [f"                  nvidia.com/gpu: {spec.gpus_per_node}"] if spec.gpus_per_node else []
    return lines + [
        "              resources:",
        "                requests:",
        f'                  cpu: "{spec.cpus}"',
        f"                  memory: {spec.memory}",
        "                limits:",
        f"                  memory: {spec.memory}",
        *gpus,
    ]


def k8s_manifest(spec: EmitSpec) -> str:
    """A JobSet of one Indexed Job with N pods, one ``resilient-train`` each, meeting on pod 0."""
    check_k8s_run_volume(spec)
    name = spec.job_name
    endpoint = f"{name}-node-0-0.{name}:{spec.rdzv_port}"
    lines = [
        f"# resilient: one recipe on {spec.nnodes} nodes x {spec.nproc_per_node} ranks (resilient-train --emit k8s).",
        "# A JobSet (https://jobset.sigs.k8s.io): kubectl apply -f THIS_FILE once the JobSet controller runs.",
        "apiVersion: jobset.x-k8s.io/v1alpha2",
        "kind: JobSet",
        "metadata:",
        f"  name: {name}",
        "spec:",
        "  # A Job that fails for good (a pod lost with its node, backoffLimit spent) restarts the whole",
        "  # set: new pods, RESTART_ATTEMPT + 1, a new rendezvous, resume from the newest common step.",
        "  failurePolicy:",
        f"    maxRestarts: {spec.max_restarts}",
        "  network:",
        f"    # Stable pod DNS names <name>-node-0-<i>.<name>: pod 0 hosts the {_meeting_point(spec)}.",
        "    enableDNSHostnames: true",
        "  replicatedJobs:",
        "  - name: node",
        "    replicas: 1",
        "    template:",
        "      spec:",
        f"        parallelism: {spec.max_nodes}",
        f"        completions: {spec.max_nodes}",
        "        completionMode: Indexed",
        f"        backoffLimit: {spec.max_restarts}",
        "        template:",
        "          spec:",
        "            # A crashed launcher restarts in the same pod: its memory-backed /dev/shm, and with",
        "            # it the RAM tier's snapshots, survives a container restart (not a new pod).",
        "            restartPolicy: OnFailure",
        # A pod being stopped (preempted, drained) gets SIGTERM: every rank saves the step it is
        # at within run.preempt_grace_s and exits 143; Kubernetes kills it only after this.
        f"            terminationGracePeriodSeconds: {shutdown_s(spec) + 30}",
        *_k8s_container(spec, endpoint),
        "            volumes:",
        "            - name: dshm",
        "              # RAM tier snapshots; counts against the pod's memory: leave room for it.",
        "              emptyDir:",
        "                medium: Memory",
        f"                sizeLimit: {spec.shm_size}",
        "            - name: runs",
        "              # run.dir (job record, events, the group's timeline) outlives a pod and is one place",
        "              # for all of them: a ReadWriteMany claim (NFS, CephFS, a cloud file store).",
        f"              # run.dir is {RUN_MOUNT}/{spec.job_name}, in place of the recipe's {spec.run_dir}.",
        "              persistentVolumeClaim:",
        f"                claimName: {spec.run_volume}",
        "",
    ]
    return "\n".join(lines)
