"""Plain PyTorch DCP calls, resilient's storage plugin: train, die in the middle of a save, resume.

    python examples/dcp_fsdp2.py --root /tmp/dcp-demo [--world 2] [--steps 8] [--every 2]

A small MLP under FSDP2 (CPU, gloo) trains with AdamW and checkpoints every ``--every`` steps with
``dcp.save(state, storage_writer=StorageWriter(root, step=n), planner=SavePlanner())``. The first
run kills one of its ranks in the middle of the save of step ``--every * 3`` (a fault point makes
the rank call ``os._exit`` after its first shard is written), and the launcher then kills the
rest, as torchrun would. The second run loads the newest committed step with ``dcp.load`` (the
half-written step is invisible), checks it, and trains to the end. ``resilient-ckpt ls ROOT``
shows the steps and the orphan attempt afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resilient import Checkpointer
from resilient.dcp import LoadPlanner, SavePlanner, StorageReader, StorageWriter


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(rank: int, world: int, args: argparse.Namespace, crash_at: int | None) -> None:
    model, opt = build(world)
    start = 0
    if Checkpointer(args.root).steps():  # resume: the newest committed step, resharded if need be
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "train": {"step": 0}}
        dcp.load(state, storage_reader=StorageReader(args.root), planner=LoadPlanner())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["train"]["step"]
        if rank == 0:
            print(f"resumed at step {start} from {args.root}", flush=True)
    for step in range(start + 1, args.steps + 1):
        torch.manual_seed(step)  # the same batch at a step whether or not the run was resumed
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step % args.every:
            continue
        if step == crash_at:  # rank 1 dies after writing its first shard of this step
            os.environ["RESILIENT_FAULTS"] = "persist.first_region_issued=exit@rank1"
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "train": {"step": step}}
        try:
            dcp.save(state, storage_writer=StorageWriter(args.root, step=step, keep_last=3), planner=SavePlanner())
        except RuntimeError as e:
            if step != crash_at:
                raise
            # The planned crash: a peer died in the middle of this save, so this rank's collective
            # fails (gloo: "Connection reset by peer"); the launcher kills it next, as torchrun would.
            print(f"rank {rank}: a peer died during the save of step {step}, as planned ({type(e).__name__})")
            sys.exit(1)
        if rank == 0:
            print(f"step {step}: committed", flush=True)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, crash_at: int | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    train(rank, world, args, crash_at)
    dist.destroy_process_group()


def launch(args: argparse.Namespace, crash_at: int | None) -> list[int | None]:
    """One run of the job; when a rank dies, the others are killed (torchrun's behaviour)."""
    from resilient.dist import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, crash_at)) for r in range(args.world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive() and p.pid:
                    os.kill(p.pid, signal.SIGKILL)
        time.sleep(0.1)
    for p in procs:
        if p.is_alive() and p.pid:
            os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=30)
    return [p.exitcode for p in procs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="checkpoint root (local path or s3://bucket/prefix)")
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo, CPU)")
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--every", type=int, default=2, help="save every N steps")
    args = parser.parse_args()
    crash_at = args.every * 3
    if "://" not in args.root:
        os.makedirs(args.root, exist_ok=True)  # Checkpointer(root).steps() reads an existing root
    codes = launch(args, crash_at)
    print(f"run 1 ended with exit codes {codes}; committed steps: {Checkpointer(args.root).steps()}", flush=True)
    if Checkpointer(args.root).steps()[-1:] != [crash_at - args.every]:
        print("expected the step before the crash to be the newest committed one", file=sys.stderr)
        return 1
    codes = launch(args, None)
    steps = Checkpointer(args.root).steps()
    print(f"run 2 ended with exit codes {codes}; committed steps: {steps}", flush=True)
    return 0 if codes == [0] * args.world and steps[-1:] == [args.steps] else 1


if __name__ == "__main__":
    sys.exit(main())
