"""``resilient-train``: launch one replica group of the trainer on this machine.

    resilient-train --nproc 4 --config configs/tiny.toml --set run.steps=20

runs ``torchrun --standalone --nproc-per-node 4 -m resilient.trainer --config ... --set ...`` and
exits with its exit code. SIGINT / SIGTERM go to torchrun, which stops its workers; if it has not
exited ``--grace-s`` seconds later, it is killed. Thin by design: all logic lives in the trainer.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from types import FrameType


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="resilient-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="ranks of the group (= parallel.dp_shard x tp)")
    parser.add_argument("--config", help="TOML recipe, e.g. configs/tiny.toml")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key (repeatable), e.g. --set parallel.tp=1",
    )  # fmt: skip
    parser.add_argument("--grace-s", type=float, default=30.0, help="wait after forwarding a signal before killing")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    return args


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for one group (standalone: a local rendezvous on a free port)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
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
    proc = subprocess.Popen(command, start_new_session=True)

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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(torchrun_command(args), args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
