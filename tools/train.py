"""``resilient-train``: launch one replica group of the trainer on this machine.

    resilient-train --nproc 4 --config configs/tiny.toml --set run.steps=20

runs ``torchrun --standalone --nproc-per-node 4 -m resilient.trainer --config ... --set ...`` and
exits with its exit code. SIGINT / SIGTERM go to torchrun, which stops its workers; if it has not
exited ``--grace-s`` seconds later, it is killed. Thin by design: all logic lives in the trainer.

    resilient-train --replica-groups 2 --nproc-per-group 2 --config configs/tiny.toml [--lighthouse URL]

runs G replica groups under a torchft quorum instead (see ``resilient.tools.replicas``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from types import FrameType


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="resilient-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, help="ranks of the group (= parallel.dp_shard x tp)")
    parser.add_argument("--replica-groups", type=int, help="replica groups under a torchft quorum")
    parser.add_argument("--nproc-per-group", type=int, help="ranks per replica group (= dp_shard x tp)")
    parser.add_argument("--lighthouse", default="", help="URL of a running torchft lighthouse (default: start one)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="torchrun restarts of the group after a rank fails (default: 0 for one group, "
                             "3 per replica group)")  # fmt: skip
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="lighthouse: a silent group is dead")
    parser.add_argument("--join-timeout-ms", type=int, default=2000, help="lighthouse: wait for joiners")
    parser.add_argument("--config", help="TOML recipe, e.g. configs/tiny.toml")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key (repeatable), e.g. --set parallel.tp=1",
    )  # fmt: skip
    parser.add_argument("--grace-s", type=float, default=30.0, help="wait after forwarding a signal before killing")
    args = parser.parse_args(argv)
    if args.replica_groups is None:
        if args.nproc is None or args.nproc < 1:
            parser.error(f"--nproc must be >= 1, got {args.nproc}")
    elif args.nproc is not None or args.nproc_per_group is None:
        parser.error("--replica-groups takes --nproc-per-group N (ranks per group), not --nproc")
    return args


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for one group (standalone: a local rendezvous on a free port)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    max_restarts = getattr(args, "max_restarts", None)
    if max_restarts:
        command += ["--max-restarts", str(max_restarts)]
    command += ["-m", "resilient.trainer"]
    if args.config:
        command += ["--config", args.config]
    for item in args.overrides:
        command += ["--set", item]
    return command


def run(command: list[str], grace_s: float) -> int:
    """Run ``command``, forwarding SIGINT/SIGTERM to it; returns its exit code (128 + N if killed by
    signal N, as a shell reports it)."""
    # Own session: a Ctrl-C in the terminal reaches torchrun once (forwarded by us), not twice; a
    # second SIGINT would cut short torchrun's shutdown of its workers.
    # A restarted group must not reuse the dead incarnation's store (pytorch/pytorch#135712).
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(command, start_new_session=True, env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # No timeout on a training run itself; the trainer bounds its own waits. Signals interrupt it.
        code = proc.wait()
        return 128 - code if code < 0 else code
    except BaseException:
        _stop(proc, grace_s)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            _stop(proc, grace_s)


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


def trainer_args(args: argparse.Namespace) -> list[str]:
    out = ["--config", args.config] if args.config else []
    return out + [arg for item in args.overrides for arg in ("--set", item)]


def run_replica_groups(args: argparse.Namespace) -> int:
    # Imported here: the single-group path stays a thin wrapper that never imports torch.
    from resilient.errors import ConfigError
    from resilient.tools.replicas import ReplicaLaunch, run_replicated
    from resilient.trainer.config import load_config

    try:
        overrides = [*args.overrides, "replica.enabled=true", f"replica.groups={args.replica_groups}"]
        config = load_config(args.config, overrides)
        launch = ReplicaLaunch(
            groups=args.replica_groups,
            nproc_per_group=args.nproc_per_group,
            run_dir=config.run.dir,
            trainer_args=trainer_args(args),
            lighthouse=args.lighthouse,
            max_restarts=3 if args.max_restarts is None else args.max_restarts,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            grace_s=args.grace_s + 10.0,  # torchrun itself waits up to 30 s for its workers
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_replicated(launch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replica_groups is not None:
        return run_replica_groups(args)
    return run(torchrun_command(args), args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
