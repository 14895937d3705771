"""Entry point of one replica group: ``torchrun --nproc-per-node N -m resilient.trainer --config R.toml
--set key=value ...``.

Reads the recipe, checks it against the launched world, joins the process group, builds the
pieces, resumes from the newest committed checkpoint (any mesh), trains to ``run.steps``, and leaves
a final checkpoint. Config errors are reported before any collective, with exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from resilient.dist import agree, free_port
from resilient.errors import ConfigError, disk_full
from resilient.recovery.ownership import RunDirClaim, claim_run_dir, job_identity
from resilient.recovery.ram import RamTier
from resilient.runfiles import RAM_FILE, SAVES_FILE, group_dir, group_id, make_run_dir, next_incarnation, write_pid
from resilient.storage.shared import check_shared_root
from resilient.trainer.build import (
    build_checkpointer,
    build_parts,
    check_world_size,
    resolve_device,
    seed_everything,
)
from resilient.trainer.config import TrainConfig, load_config
from resilient.trainer.launching.lighthouse import set_parent_death_signal
from resilient.trainer.loop import Trainer
from resilient.trainer.observing.observe import RunObserver
from resilient.trainer.observing.outputs import RunOutputs
from resilient.trainer.observing.peak import find_peak, model_matmul_shapes
from resilient.trainer.observing.quiet import RUNTIME_EXIT, report_failure
from resilient.trainer.observing.timing import StartupClock, process_start_time
from resilient.trainer.preempt import PREEMPTED_EXIT, Preempted

log = logging.getLogger(__name__)

CONFIG_ERROR_EXIT = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m resilient.trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML recipe (e.g. configs/tiny.toml); omitted: all defaults")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, value as a TOML literal (repeatable): --set parallel.tp=1",
    )
    return parser.parse_args(argv)


def _setup_logging(rank: int) -> None:
    # Rank 0 tells the story; the other ranks speak up only for warnings and errors.
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    # DTensor warns on every full_tensor() of a _StridedShard (FSDP x TP): noise for a trainer.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # boto3's INFO ("Found credentials in environment variables") is not the run's story.
    for name in ("botocore", "boto3", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _init_process_group(config: TrainConfig, device: torch.device) -> None:
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=config.run.collective_timeout_s))


def build_observer(config: TrainConfig, clock: StartupClock) -> RunObserver:
    """This rank's observer; the group's incarnation is counted by rank 0 and shared (collective)."""
    # Rank 0 counts; an error there (a full disk) is raised on every rank, not on rank 0 alone.
    incarnation = int(agree(lambda: next_incarnation(config.run.dir, group_id()), src=0, what="counting the start"))
    return RunObserver(
        config,
        world=dist.get_world_size(),
        incarnation=incarnation,
        directory=group_dir(config.run.dir),
        clock=clock,
    )


def build_trainer(config: TrainConfig, device: torch.device, clock: StartupClock | None = None) -> Trainer:
    """Every piece of the run on this rank (the process group must be up)."""
    observer = build_observer(config, clock or StartupClock(process_start_time()))
    seed_everything(config.run.seed)
    mesh, parts = build_parts(config, device)
    outputs = RunOutputs(
        group_dir(config.run.dir),
        enabled=dist.get_rank() == 0,
        log_samples=config.data.log_samples,
        log_every=config.run.log_every,
        steps=config.run.steps,
    )
    dtype = torch.bfloat16 if config.parallel.mixed_precision == "bf16" else torch.float32
    peak = find_peak(str(device), config.run.peak_flops, dtype, model_matmul_shapes(config))
    outputs.context = {"layout": observer.layout}
    if config.metrics.tensorboard:
        outputs.open_tensorboard()
    outputs.write_config(
        config.to_dict(),
        {
            "world_size": dist.get_world_size(),
            "group": group_id(),
            "device": str(device),
            "incarnation": observer.incarnation,
            "peak_flops": peak.flops,
            "peak_flops_source": peak.source,
            "peak_flops_key": peak.key,
        },
    )
    saves_log = os.path.join(outputs.directory, SAVES_FILE) if outputs.enabled else None
    trainer_class = Trainer
    if config.replica.enabled:
        from resilient.trainer.replicated import ReplicatedTrainer  # imports torchft: only when asked

        trainer_class = ReplicatedTrainer
    # The RAM tier before the trainer: a replicated trainer builds its torchft Manager, which starts
    # heartbeating to the lighthouse, and the first quorum should follow that closely (a group that
    # heartbeats without joining holds up the others' quorum up to the lighthouse's join timeout).
    ram = build_ram_tier(config, outputs.directory) if config.checkpoint.memory_every > 0 else None
    trainer = None
    try:
        checkpointer = build_checkpointer(config, saves_log)
        # A root that is not shared would hang the first save for the whole commit timeout.
        check_shared_root(checkpointer.store, setting="checkpoint.url")
        trainer = trainer_class(config, mesh, parts, checkpointer, outputs, device, observer)
        trainer.ram = ram
        trainer.peak, trainer.peak_flops = peak, peak.flops
        trainer.install_configured_hooks()
    except BaseException:
        # Nothing else holds these yet: close the RAM channel (and a half-built trainer's torchft
        # Manager, writer, loader workers) before the error propagates.
        if trainer is not None:
            _close_quietly(trainer)
        elif ram is not None:
            ram.close()
        raise
    return trainer


def build_ram_tier(config: TrainConfig, group_directory: str) -> RamTier:
    """The RAM tier of this rank, its channel open (collective over the group)."""
    ram = RamTier(
        config.recovery,
        keep=config.checkpoint.memory_keep,
        run_dir=config.run.dir,
        group=group_id(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        fingerprint=ram_fingerprint(config),
        stats_path=os.path.join(group_directory, RAM_FILE),
    )
    ram.start()
    return ram


def ram_fingerprint(config: TrainConfig) -> dict[str, int]:
    """The layout a RAM snapshot was taken on: restored only onto the same one (a snapshot holds
    each rank's own shards). ``pp`` only when pipelining, so older snapshots keep matching."""
    p = config.parallel
    layout = {"dp_shard": p.dp_shard, "tp": p.tp}
    if p.pp > 1:
        layout.update(pp=p.pp, pp_stages=p.num_stages)
    return layout


def _config_and_claim(args: argparse.Namespace, rank: int) -> tuple[TrainConfig, RunDirClaim]:
    """The recipe, checked, and this job's claim on its run.dir: every mistake known before the
    process group is made (ConfigError; OSError for a full disk), with the same outcome on every rank."""
    config = load_config(args.config, args.overrides)
    check_world_size(config, int(os.environ.get("WORLD_SIZE", "1")))
    group_id()
    # Every rank: a run.dir none can write is one line from rank 0, not a traceback from the ranks
    # that do not write the claim (plain torchrun; resilient-train checked it already).
    make_run_dir(config.run.dir)
    # Every rank checks (the same outcome on each), rank 0 keeps the record's heartbeat fresh.
    return config, claim_run_dir(config.run.dir, job_identity(), write=rank == 0)


def main(argv: list[str] | None = None) -> int:
    parent = os.getppid()  # torchrun, read first: set_parent_death_signal checks it is still there
    clock = StartupClock(process_start_time())
    clock.mark("imports")
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        config, claim = _config_and_claim(args, rank)
    except (ConfigError, OSError) as e:
        if not isinstance(e, ConfigError) and not disk_full(e):
            raise
        if rank == 0 or os.environ.get("LOCAL_RANK") == "0":  # one line per node: a node's own mistake too
            print(f"error: {e}", file=sys.stderr)
        return CONFIG_ERROR_EXIT if isinstance(e, ConfigError) else RUNTIME_EXIT
    _setup_logging(rank)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun gone (SIGKILLed, OOM-killed): stop as on a preemption rather than live on in a
        # session of our own; the ranks get it together and save the step they are at.
        set_parent_death_signal(signal.SIGTERM, parent)
    # Tools and tests find (and kill) this rank by its pid file; a torchrun restart rewrites it.
    write_pid(config.run.dir, group_id(), rank)
    if "MASTER_ADDR" not in os.environ:  # plain `python -m resilient.trainer`: a one-rank world
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    device = resolve_device(config.run.device)
    if device.type == "cuda" and config.run.hang_timeout_s > 0:
        # NCCL's flight recorder dumps its last collectives next to the watchdog's stacks on a
        # collective timeout; read when the process group is created, so set before it.
        from resilient.trainer.observing.watchdog import flight_recorder_env

        for key, value in flight_recorder_env(group_dir(config.run.dir)).items():
            os.environ.setdefault(key, value)
    _init_process_group(config, device)
    clock.mark("process_group")
    trainer = None
    try:
        trainer = build_trainer(config, device, clock)
        clock.mark("model")
        with trainer.preemption:
            trainer.run()
        # Another job that took the run dir over (its record found by rank 0's heartbeat): this
        # run's outputs are mixed with that job's, so it does not end as a success; on every rank.
        agree(claim.check, what="run dir ownership")
        trainer.close()
    except Preempted as stop:
        _close_quietly(trainer)
        return PREEMPTED_EXIT if stop.committed else RUNTIME_EXIT  # not resumable from the stop step
    except BaseException as e:
        if trainer is not None:
            _close_quietly(trainer)
        code = report_failure(config.run.dir, rank, e)
        if code is None:
            raise
        return code
    finally:
        dist.destroy_process_group()
        claim.close()
    return 0


def _close_quietly(trainer: Trainer) -> None:
    """Close after a failure: the first error is the one to report, not a follow-up from closing."""
    try:
        trainer.close()
    except Exception as e:
        log.warning("closing the trainer after a failure raised too: %s", e)
