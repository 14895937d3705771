"""One torchrun job: the command ``resilient-train`` runs for a lone group, and running it.

    resilient-train --nproc 4 --config configs/tiny.toml --set run.steps=20

runs ``torchrun --standalone --nproc-per-node 4 -m resilient.trainer --config ... --set ...``
(``torchrun_command``, ``run``) and exits with its exit code. SIGINT / SIGTERM (and
``run.preempt_signal``) go to torchrun, which passes them to its workers: SIGTERM and the preempt
signal make them save the step they are at and exit 143 (``resilient.trainer.preempt``); torchrun
waits ``run.preempt_grace_s`` plus a margin before it kills them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from types import FrameType

from resilient.errors import ConfigError
from resilient.trainer.config import TrainConfig
from resilient.trainer.launching.lighthouse import die_with_parent
from resilient.trainer.launching.multinode import MULTINODE_RESTARTS, rendezvous_of
from resilient.trainer.launching.preemption import PreemptMark, preempt_flags


def trainer_args(args: argparse.Namespace) -> list[str]:
    """The ``--config`` / ``--set`` arguments ``resilient-train`` passes on to every rank."""
    out = ["--config", args.config] if args.config else []
    return out + [arg for item in args.overrides for arg in ("--set", item)]


def check_nproc(config: TrainConfig, nproc: int | None) -> int:
    """``--nproc`` as given, or the recipe's pp x dp_shard x tp; ConfigError when the two disagree."""
    p = config.parallel
    if nproc is None:
        return p.world_size
    if nproc != p.world_size:
        raise ConfigError(
            f"--nproc {nproc} but parallel.pp={p.pp} x parallel.dp_shard={p.dp_shard} x parallel.tp={p.tp} = "
            f"{p.world_size} ranks: drop --nproc (it defaults to {p.world_size}), or set parallel.pp / "
            f"parallel.dp_shard / parallel.tp so that their product is {nproc}"
        )
    return nproc


def torchrun_command(args: argparse.Namespace, quiet: bool = False, config: TrainConfig | None = None) -> list[str]:
    """The torchrun command line for one group: standalone (a local rendezvous on a free port), or
    this node's share of a multi-node group (``resilient.trainer.launching.multinode``). ``args``: ``nproc``
    (ranks on this node), ``config``, ``overrides`` and optionally ``max_restarts`` and the
    multi-node flags, as parsed. ``quiet``: torchrun without its own traceback when a rank fails
    (``resilient.trainer.observing.quiet``). ``config``: the loaded recipe, for the preemption flags."""
    runner = "resilient.trainer.observing.quiet" if quiet else "torch.distributed.run"
    rendezvous = rendezvous_of(args) if getattr(args, "nnodes", None) else None
    where = ["--standalone"] if rendezvous is None else rendezvous.torchrun_args()
    command = [sys.executable, "-m", runner, *where, "--nproc-per-node", str(args.nproc)]
    max_restarts = getattr(args, "max_restarts", None)
    if max_restarts is None and rendezvous is not None:
        max_restarts = MULTINODE_RESTARTS
    if max_restarts:
        command += ["--max-restarts", str(max_restarts)]
    if config is not None:
        command += preempt_flags(config)
    return command + ["-m", "resilient.trainer", *trainer_args(args)]


def run(
    command: list[str],
    grace_s: float,
    env: dict[str, str] | None = None,
    forward_signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
    watch: Callable[[int], bool] | None = None,
) -> int:
    """Run ``command`` (with ``env`` added to ours), forwarding ``forward_signals`` to it; returns
    its exit code (128 + N if killed by signal N, as a shell reports it). ``watch(pid)`` is called
    about every second meanwhile, with torchrun's pid (``multinode.RendezvousWait`` says whom the
    node waits for); when it returns True, torchrun is stopped (SIGTERM): a rank reported an error
    that its restarts would only meet again."""
    # Own session: a Ctrl-C in the terminal reaches torchrun once (forwarded by us), not twice; a
    # second SIGINT would cut short torchrun's shutdown of its workers.
    # A restarted group must not reuse the dead incarnation's store (pytorch/pytorch#135712).
    # Every signal this launcher sends asks the ranks to save and stop: marked, so that they can tell
    # it from the SIGTERM torchrun sends on its own when a rank failed (``trainer.preempt``).
    mark = PreemptMark()
    env = {**os.environ, **(env or {}), **mark.env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if _nproc_of(command) > 1:
        # What torchrun sets for more than one rank when unset, without the 5-line warning it
        # prints above the one line the operator should read.
        env.setdefault("OMP_NUM_THREADS", "1")
    # SIGTERM when this launcher dies however it dies: torchrun then stops its workers (they save).
    try:
        proc = subprocess.Popen(command, start_new_session=True, env=env, preexec_fn=die_with_parent(signal.SIGTERM))
    except BaseException:
        mark.close()
        raise

    def forward(signum: int, frame: FrameType | None) -> None:
        if proc.poll() is None:
            mark.set()
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in forward_signals}
    try:
        # No timeout on a training run itself; the trainer bounds its own waits. Signals interrupt it.
        stopping = False
        while (code := _wait_a_second(proc)) is None:
            if watch is not None and watch(proc.pid) and not stopping:
                stopping = True
                mark.set()
                proc.terminate()
        return shell_code(code)
    except BaseException:
        _stop(proc, grace_s, mark)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            _stop(proc, grace_s, mark)
        mark.close()


def _wait_a_second(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return None


def _nproc_of(command: list[str]) -> int:
    flag = "--nproc-per-node"
    return int(command[command.index(flag) + 1]) if flag in command else 1


def _stop(proc: subprocess.Popen, grace_s: float, mark: PreemptMark) -> None:
    if proc.poll() is None:
        mark.set()
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


def shell_code(code: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a process killed by signal N."""
    return 128 - code if code < 0 else code
