"""``resilient-train --emit slurm``: one sbatch script that starts a ``resilient-train`` per node
under ``srun`` (the spec, its checks and the node's command line: ``resilient.trainer.launching.emit``)."""

from __future__ import annotations

import shlex

from resilient.trainer.launching.emit import (
    EmitSpec,
    kibibytes,
    meeting_point,
    node_command,
    shutdown_s,
)


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
        f"#SBATCH --mem={kibibytes(spec.mem_per_node) // 1024}M" if spec.mem_per_node else "#SBATCH --mem=0",
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
    need = kibibytes(spec.shm_size)
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
        f"# The {meeting_point(spec)} lives on the allocation's first node.",
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


# -- the job's secret (recovery/channel/secret.py; README "Security") -----------------------


def _slurm_job_secret() -> list[str]:
    """Every node's ranks share one secret (srun passes the environment on), made once per run of
    the script unless the operator exported one: else each node would make its own job.key."""
    return [
        "# One job secret for every node (it keys buddy copies, heals and quorum membership).",
        'export RESILIENT_JOB_SECRET="${RESILIENT_JOB_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d " \\n")}"',
    ]
