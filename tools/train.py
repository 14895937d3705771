"""``resilient-train``: train a recipe here, on several nodes or as replica groups; or print cluster files.

    resilient-train --nproc 4 --config configs/tiny.toml --set run.steps=20

runs ``torchrun --standalone --nproc-per-node 4 -m resilient.trainer --config ... --set ...`` and
exits with its exit code. SIGINT / SIGTERM go to torchrun, which stops its workers; if it has not
exited ``--grace-s`` seconds later, it is killed.

    resilient-train --replica-groups 2 --nproc-per-group 2 --config configs/tiny.toml [--lighthouse URL]

runs G replica groups under a torchft quorum instead.

    resilient-train --nnodes 2 --node-rank R --rdzv-endpoint node0:29400 --rdzv-id job7 --config ...

on every node runs one group across the nodes (torchrun's c10d rendezvous,
``resilient.trainer.launching.multinode``); with ``--replica-groups`` node R runs groups R, R+N, ... and
node 0 starts the job's lighthouse on ``--rdzv-endpoint``. ``--emit slurm|k8s`` prints an sbatch
script or a JobSet manifest that does this on a cluster (``resilient.trainer.launching.emit``). An argparse
shell: the launcher is ``resilient.trainer.launching.launch``.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import urllib.parse

from resilient.errors import ConfigError, ResilientError, disk_full
from resilient.runfiles import METRICS_FILE, group_file, group_id, logs_dir, make_run_dir, read_jsonl_by_step
from resilient.tools.cli import OneLineParser
from resilient.trainer.config import TrainConfig, load_config
from resilient.trainer.launching.emit import (
    DEFAULT_RDZV_PORT,
    DEFAULT_SHM,
    EMIT_KINDS,
    EmitSpec,
    check_k8s_root,
    check_slurm_run_dir,
    emit_flag_error,
)
from resilient.trainer.launching.emit_k8s import k8s_manifest
from resilient.trainer.launching.emit_slurm import slurm_script
from resilient.trainer.launching.launch import ReplicaLaunch, run_replicated
from resilient.trainer.launching.multinode import (
    MULTINODE_RESTARTS,
    NODE_RANK_ENV,
    RendezvousWait,
    flag_error,
    parse_nnodes,
    rendezvous_of,
    split_ranks,
)
from resilient.trainer.launching.preemption import (
    MarkError,
    forwarded_signals,
    launcher_grace_s,
    preempt_flags,
    preempted_events,
    preempted_exit,
)
from resilient.trainer.launching.torchrun import check_nproc, run, torchrun_command, trainer_args
from resilient.trainer.observing.quiet import DEBUG_ENV, ERROR_EXIT, RUNTIME_EXIT, final_claim_since, reported_since

PROG = "resilient-train"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nproc", type=int, help="ranks of the group (default: parallel.pp x dp_shard x tp of the recipe)"
    )
    parser.add_argument("--replica-groups", type=int, help="replica groups under a torchft quorum")
    parser.add_argument("--nproc-per-group", type=int, help="ranks per replica group (= pp x dp_shard x tp)")
    parser.add_argument("--lighthouse", default="", help="URL of a running torchft lighthouse (default: start one)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="torchrun restarts of the group after a rank fails (default: 0 on one node, else 3)",
    )
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="lighthouse: a silent group is dead")
    parser.add_argument("--join-timeout-ms", type=int, default=2000, help="lighthouse: wait for joiners")
    parser.add_argument("--config", help="TOML recipe, e.g. configs/tiny.toml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (repeatable), e.g. --set parallel.tp=1",
    )
    parser.add_argument("--grace-s", type=float, default=30.0, help="wait after forwarding a signal before killing")
    parser.add_argument("--debug", action="store_true", help="show every rank's traceback on a failure")
    _add_cluster_flags(parser)
    if not (sys.argv[1:] if argv is None else argv):
        # Nothing given: training a built-in default into ./runs/default would surprise; say how.
        parser.error("give a recipe, e.g. --config configs/tiny.toml")
    args = parser.parse_args(argv)
    error = (emit_flag_error(args) if args.emit else flag_error(args)) or _launcher_flag_error(args)
    if error:
        parser.error(error)
    if args.replica_groups is None:
        if args.nproc is not None and args.nproc < 1:
            parser.error(f"--nproc must be >= 1, got {args.nproc}")
    elif args.nproc is not None or args.nproc_per_group is None:
        parser.error("--replica-groups takes --nproc-per-group N (ranks per group), not --nproc")
    return args


def _launcher_flag_error(args: argparse.Namespace) -> str | None:
    """The launcher's own flags that do not fit, in one line (None when they all do)."""
    if not 0 <= args.grace_s < math.inf:  # (NaN too: every wait has a bound)
        return f"--grace-s must be a finite number of seconds >= 0, got {args.grace_s}"
    if args.lighthouse and not _is_http_url(args.lighthouse):
        return (
            f"--lighthouse takes the URL of a running torchft lighthouse, http://HOST:PORT, got "
            f"{args.lighthouse!r} (or drop it: the launcher starts one)"
        )
    return None


def _is_http_url(text: str) -> bool:
    """http(s)://HOST[:PORT][/...], HOST an IPv6 address in brackets too (no port: the scheme's)."""
    try:
        url = urllib.parse.urlsplit(text)
        url.port  # noqa: B018 - raises ValueError for a port that is no number in range
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname)


def _add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    nodes = parser.add_argument_group("several nodes (torchrun's rendezvous flags; run the same command on every node)")
    nodes.add_argument("--nnodes", help="N nodes, or MIN:MAX for an elastic job (default: this machine alone)")
    nodes.add_argument("--node-rank", type=int, help="this node's rank in [0, N) (fixed --nnodes only)")
    nodes.add_argument(
        "--rdzv-endpoint",
        help="HOST:PORT of the c10d rendezvous store, the same on every node "
        "(with --replica-groups: where node 0 starts the job's lighthouse)",
    )
    nodes.add_argument("--rdzv-id", help="the job's rendezvous id: the same on every node, new for each launch")
    nodes.add_argument("--nproc-per-node", type=int, help="ranks per node (default: pp x dp_shard x tp / nodes)")
    emit = parser.add_argument_group("cluster files (print, do not run)")
    emit.add_argument(
        "--emit",
        choices=EMIT_KINDS,
        help="print an sbatch script (slurm) or a JobSet manifest (k8s) for --nnodes (default 2) nodes",
    )
    emit.add_argument("--job-name", default="resilient", help="SLURM job / JobSet name")
    emit.add_argument("--image", help="k8s (required): container image with resilient installed")
    emit.add_argument(
        "--run-volume",
        metavar="CLAIM",
        help="k8s (required): a ReadWriteMany PersistentVolumeClaim every pod mounts for run.dir",
    )
    emit.add_argument("--time", default="24:00:00", help="slurm: the job's time limit, [DAYS-]HH:MM:SS")
    emit.add_argument("--cpus-per-node", type=int, default=0, help="CPUs per node (default: 8 per rank)")
    emit.add_argument(
        "--mem-per-node", default="", help="memory per node, e.g. 512Gi (default k8s: /dev/shm + 16Gi per rank)"
    )
    emit.add_argument(
        "--gpus-per-node", type=int, help="GPUs to request per node (default: ranks per node; 0 when run.device is cpu)"
    )
    emit.add_argument("--shm-size", default=DEFAULT_SHM, help=f"RAM tier's /dev/shm per node (default {DEFAULT_SHM})")
    emit.add_argument(
        "--rdzv-port",
        type=int,
        default=DEFAULT_RDZV_PORT,
        help=f"rendezvous (or lighthouse) port on node 0 (default {DEFAULT_RDZV_PORT})",
    )


def emit_files(args: argparse.Namespace) -> int:
    """Print the sbatch script or manifest for ``args``; the recipe is checked here first."""
    try:
        groups = args.replica_groups or 0
        replica = ["replica.enabled=true", f"replica.groups={groups}"] if groups else []
        config = load_config(args.config, [*args.overrides, *replica])
        low, high = parse_nnodes(args.nnodes or "2")
        if args.emit == "k8s":
            check_k8s_root(config.checkpoint.url)
        else:
            check_slurm_run_dir(config.run.dir)
        if groups:
            _check_group_ranks(config.parallel.world_size, args.nproc_per_group)
            per_node = groups // high * args.nproc_per_group
        else:
            per_node = split_ranks(config.parallel.world_size, high, args.nproc_per_node, args.nproc)
        spec = EmitSpec(
            replica_groups=groups,
            nproc_per_group=args.nproc_per_group or 0,
            job_name=args.job_name,
            min_nodes=low,
            max_nodes=high,
            nproc_per_node=per_node,
            gpus_per_node=_gpus_per_node(args, config.run.device, per_node),
            image=args.image or "",
            time_limit=args.time,
            cpus_per_node=args.cpus_per_node,
            mem_per_node=args.mem_per_node,
            shm_size=args.shm_size,
            rdzv_port=args.rdzv_port,
            max_restarts=MULTINODE_RESTARTS if args.max_restarts is None else args.max_restarts,
            trainer_args=trainer_args(args),
            preempt_grace_s=config.run.preempt_grace_s,
            preempt_signal=config.run.preempt_signal or "SIGUSR1",
            run_dir=config.run.dir,
            run_volume=args.run_volume or "",
        )
        text = slurm_script(spec) if args.emit == "slurm" else k8s_manifest(spec)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def _check_group_ranks(world_size: int, nproc_per_group: int) -> None:
    if nproc_per_group != world_size:
        raise ConfigError(
            f"--nproc-per-group {nproc_per_group} but parallel.pp x dp_shard x tp = {world_size} ranks per group: "
            f"use --nproc-per-group {world_size}, or set parallel.pp / parallel.dp_shard / parallel.tp so that "
            f"their product is {nproc_per_group}"
        )


def _gpus_per_node(args: argparse.Namespace, device: str, per_node: int) -> int:
    if args.gpus_per_node is not None:
        return args.gpus_per_node
    return 0 if device == "cpu" else per_node  # one GPU per rank


def interrupted_line(config: TrainConfig) -> str:
    """What the operator reads after Ctrl-C: where the run stood and what survives of it."""
    steps = read_jsonl_by_step(group_file(config.run.dir, METRICS_FILE, 0))
    from resilient.storage.checkpointer import Checkpointer  # deferred: the config check skips torch

    try:
        committed = Checkpointer(config.checkpoint.url).steps()
    except ResilientError:
        committed = []
    last = committed[-1] if committed else "none"
    return f"interrupted at step {max(steps, default=0)}; last committed step {last}; rerun the same command to resume"


def run_replica_groups(args: argparse.Namespace) -> int:
    try:
        overrides = [*args.overrides, "replica.enabled=true", f"replica.groups={args.replica_groups}"]
        config = load_config(args.config, overrides)
        _check_group_ranks(config.parallel.world_size, args.nproc_per_group)  # before anything starts
        make_run_dir(config.run.dir)
        launch = ReplicaLaunch(
            groups=args.replica_groups,
            nproc_per_group=args.nproc_per_group,
            run_dir=config.run.dir,
            trainer_args=trainer_args(args),
            lighthouse=args.lighthouse,
            max_restarts=3 if args.max_restarts is None else args.max_restarts,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            grace_s=launcher_grace_s(config, args.grace_s),  # torchrun waits this long for its workers
            nnodes=int(args.nnodes or 1),  # flag_error: a fixed N with replica groups
            node_rank=args.node_rank or 0,
            lighthouse_at=args.rdzv_endpoint or "",
            env={NODE_RANK_ENV: str(args.node_rank)} if args.nnodes else {},
            torchrun_flags=preempt_flags(config),
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk where run.dir goes (make_run_dir)
        return _cannot_start(e)
    # The ranks write to <run.dir>/logs/group<G>.log; what the operator needs from them is said here.
    started = time.time() - 1.0  # mtime granularity and clock skew between the ranks' writes and here
    try:
        code = run_replicated(launch, forwarded_signals(config))
    except MarkError as e:  # raised before anything started
        return _cannot_start(e)
    stopped = preempted_events(config.run.dir, started, launch.groups_here())
    line = _failure_line(config.run.dir, started, code, stopped)
    # The groups stopped for a preemption: 143 (resumable from the stop step) only if every group
    # that stopped saw that one step committed and none failed for a reason of its own (one that
    # failed writing the stop step says so, and a rerun would not fix it by itself).
    if stopped and line is None:
        code, why = preempted_exit(stopped)
        if why:
            print(why, file=sys.stderr)
        return code
    if code == 128 + signal.SIGINT:
        print(interrupted_line(config), file=sys.stderr)
    elif code != 0 or line:
        where = f"the groups' logs are in {logs_dir(config.run.dir)}"
        print(f"{line} ({where})" if line else f"error: a replica group exited with {code}; {where}", file=sys.stderr)
        if not line:
            return code
        return RUNTIME_EXIT if disk_full(ResilientError(line)) else ERROR_EXIT  # a full disk is no bad input
    return code


def _cannot_start(error: MarkError | OSError) -> int:
    """One line for what stopped the launch before anything started: 1 for the machine's failure
    (no usable temporary folder, a full disk where run.dir goes), else 2."""
    print(f"error: {error}", file=sys.stderr)
    return RUNTIME_EXIT if isinstance(error, MarkError) or disk_full(error) else ERROR_EXIT


def _failure_line(run_dir: str, started: float, code: int, stopped: list[dict]) -> str | None:
    """The error line that says why the replica groups ended (None: they did not fail). A claim
    (``report_failure``) is the first error of a torchrun launch, and torchrun may have restarted
    its group out of it: only a final claim, or one made after the groups were asked to stop,
    overrides a preemption, and a job whose groups all exited 0 failed only on a final claim."""
    final = final_claim_since(run_dir, started)
    if final or code == 0:
        return final
    return reported_since(run_dir, min(e["t"] for e in stopped) if stopped else started)


def run_one_group(args: argparse.Namespace) -> int:
    # Every config mistake is found here, in a second, before torchrun starts any worker.
    env: dict[str, str] = {}
    try:
        config = load_config(args.config, args.overrides)
        if args.nnodes is None:
            args.nproc = check_nproc(config, args.nproc if args.nproc_per_node is None else args.nproc_per_node)
        else:
            high = parse_nnodes(args.nnodes)[1]
            args.nproc = split_ranks(config.parallel.world_size, high, args.nproc_per_node, args.nproc)
            env = rendezvous_of(args).env()
        group_id()
        make_run_dir(config.run.dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk where run.dir goes (make_run_dir)
        return _cannot_start(e)
    started = time.time() - 1.0  # as in run_replica_groups
    command = torchrun_command(args, quiet=not args.debug, config=config)
    waiting = RendezvousWait(rendezvous_of(args), config.run.dir) if args.nnodes else None

    def watch(torchrun_pid: int) -> bool:
        # A setting to change fails every restart the same way: stop torchrun at the first.
        stop = final_claim_since(config.run.dir, started) is not None
        return (waiting(torchrun_pid) if waiting else False) or stop

    try:
        code = run(command, launcher_grace_s(config, args.grace_s), env, forwarded_signals(config), watch)
    except MarkError as e:  # raised before torchrun started
        return _cannot_start(e)
    final = final_claim_since(config.run.dir, started)
    if final:  # the rank printed the line
        return RUNTIME_EXIT if disk_full(ResilientError(final)) else ERROR_EXIT
    stopped = preempted_events(config.run.dir, started)
    # Stopped ranks exit 143, and torchrun stopped by a signal 128 + that signal; a rank that failed
    # on its own exits 1 or 2 (it printed why), and 0 is a run that went on to its end after a
    # restart. The newest stop is the one the next start resumes from.
    if stopped and code >= 128:
        code, why = preempted_exit(stopped[-1:])
        if why:
            print(why, file=sys.stderr)
        return code
    if code == 128 + signal.SIGINT:
        print(interrupted_line(config), file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.config is None and not args.emit:
        print(
            f"{PROG}: error: --config RECIPE is required (e.g. --config configs/tiny.toml): it says what to train",
            file=sys.stderr,
        )
        return 2
    if args.emit:
        return emit_files(args)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the workers inherit it
    if args.replica_groups is not None:
        return run_replica_groups(args)
    return run_one_group(args)


if __name__ == "__main__":
    sys.exit(main())
