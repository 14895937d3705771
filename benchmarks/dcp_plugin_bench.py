"""resilient.dcp against DCP's own FileSystemWriter/Reader, through plain DCP calls, in ONE run.

    python benchmarks/dcp_plugin_bench.py [--total-gib 1.0] [--repeats 3] [--dir /tmp] [--width 2048]

ckpt_bench's state (4 gloo ranks, Linear layers under FSDP2, one AdamW step, ``get_state_dict``).
Each round, in alternating order: ``dcp.save`` through a fresh ``resilient.dcp.StorageWriter``
(DCP's default planner, as a plain DCP user calls it), through a fresh ``StorageWriter`` with our
``SavePlanner``, through a fresh ``FileSystemWriter(sync_files=True)``; and a fresh ``Checkpointer``
per save, waited on (what a plugin built on the Checkpointer would pay). A world of 3 ranks then
loads the newest 4-rank steps with ``dcp.load`` through ``StorageReader`` and through
``FileSystemReader`` (reshard 4->3), each load checked against a fingerprint of the saved state.
Round 0 of each world is an untimed warm-up. Every time is the max over ranks after a barrier.
stdout carries JSON lines (one per result, then ratios: > 1 means resilient is faster).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

from bench_common import emit, ratio_line, result_line, run_world, setup_logging, timed
from bench_fsdp_state import build_state, check_fingerprint, fingerprint, fresh_state, state_bytes, zero_state
from ckpt_bench import BenchConfig

SAVE_WORLD, LOAD_WORLD = 4, 3
SAVES = ("plugin", "plugin_our_planner", "filesystem", "checkpointer_one_shot")
log = logging.getLogger("ckpt_bench")


def _rotate(round_: int, impls: tuple[str, ...]) -> list[str]:
    """Who goes first in a round, rotating: no side always meets another's dirty pages first."""
    k = round_ % len(impls)
    return list(impls[k:] + impls[:k])


def _clear(path: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _save(impl: str, state: dict, cfg: BenchConfig, round_: int) -> None:
    import torch.distributed.checkpoint as dcp

    from resilient import Checkpointer
    from resilient.dcp import SavePlanner, StorageWriter

    if impl == "plugin":
        dcp.save(state, storage_writer=StorageWriter(_root(cfg, impl), step=round_))
    elif impl == "plugin_our_planner":
        dcp.save(state, storage_writer=StorageWriter(_root(cfg, impl), step=round_), planner=SavePlanner())
    elif impl == "filesystem":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(_fs_dir(cfg, round_), sync_files=True))
    else:
        with Checkpointer(_root(cfg, impl)) as ckpt:
            ckpt.save(round_, state).wait()


def _root(cfg: BenchConfig, impl: str) -> str:
    return os.path.join(cfg.root, impl)


def _fs_dir(cfg: BenchConfig, round_: int) -> str:
    return os.path.join(cfg.root, f"filesystem-{round_}")


def save_world(rank: int, world: int, cfg: BenchConfig) -> dict:
    from resilient.manifest import step_dir

    _model, _opt, state = build_state(cfg, seed=1)
    total, _local = state_bytes(state)
    times: dict[str, list[float]] = {impl: [] for impl in SAVES}
    for round_ in range(cfg.repeats + 1):
        for impl in _rotate(round_, SAVES):
            seconds = timed(lambda impl=impl, round_=round_: _save(impl, state, cfg, round_))
            log.info("save %s round %d: %.3f s", impl, round_, seconds)
            if round_ > 0:
                times[impl].append(seconds)
        if round_ > 0:  # keep the newest steps only: the load world reads them
            for impl in ("plugin", "plugin_our_planner", "checkpointer_one_shot"):
                _clear(os.path.join(_root(cfg, impl), step_dir(round_ - 1)))
            _clear(_fs_dir(cfg, round_ - 1))
    return {"bytes": total, "fingerprint": fingerprint(state), "seconds": times}


def load_world(rank: int, world: int, cfg: BenchConfig, saved: list[list[float]]) -> dict:
    import torch.distributed.checkpoint as dcp

    from resilient.dcp import StorageReader

    model, opt, _ = build_state(cfg, seed=2)
    step = cfg.repeats
    times: dict[str, list[float]] = {"plugin": [], "filesystem": []}
    for round_ in range(cfg.repeats + 1):
        for impl in _rotate(round_, ("plugin", "filesystem")):
            state = fresh_state(model, opt)
            zero_state(state)
            if impl == "plugin":
                reader = StorageReader(_root(cfg, "plugin"), step=step, trust_pickle=True)
            else:
                reader = dcp.FileSystemReader(_fs_dir(cfg, step))
            seconds = timed(lambda s=state, r=reader: dcp.load(s, storage_reader=r))
            check_fingerprint(fingerprint(state), saved, f"{impl} load 4->{world}")
            log.info("load %s 4->%d round %d: %.3f s (verified)", impl, world, round_, seconds)
            if round_ > 0:
                times[impl].append(seconds)
    return {"seconds": times}


def run(cfg: BenchConfig) -> None:
    saved = run_world(save_world, SAVE_WORLD, cfg)
    nbytes, seconds = saved[0]["bytes"], saved[0]["seconds"]
    lines: dict[str, dict[str, Any]] = {}
    for impl in SAVES:
        lines[f"save_{impl}"] = result_line(
            "dcp_save", impl, nbytes, seconds[impl], from_world=SAVE_WORLD, to_world=SAVE_WORLD
        )
        emit(lines[f"save_{impl}"])
    loaded = run_world(load_world, LOAD_WORLD, cfg, saved[0]["fingerprint"])[0]["seconds"]
    for impl in ("plugin", "filesystem"):
        lines[f"load_{impl}"] = result_line(
            "dcp_load", impl, nbytes, loaded[impl], from_world=SAVE_WORLD, to_world=LOAD_WORLD
        )
        emit(lines[f"load_{impl}"])
    emit(ratio_line("dcp_save_plugin_over_filesystem", lines["save_plugin"], lines["save_filesystem"]))
    emit(
        ratio_line(
            "dcp_save_plugin_our_planner_over_filesystem", lines["save_plugin_our_planner"], lines["save_filesystem"]
        )
    )
    one_shot = lines["save_checkpointer_one_shot"]
    emit(ratio_line("checkpointer_one_shot_over_filesystem", one_shot, lines["save_filesystem"]))
    emit(ratio_line("dcp_load_4to3_plugin_over_filesystem", lines["load_plugin"], lines["load_filesystem"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-gib", type=float, default=1.0, help="params + AdamW state over all ranks")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds of each kind")
    parser.add_argument("--width", type=int, default=2048, help="features of each Linear layer")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="parent of the scratch directory")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit for each world")
    args = parser.parse_args(argv)
    setup_logging(None)
    root = tempfile.mkdtemp(prefix="dcp-plugin-bench-", dir=args.dir)
    try:
        cfg = BenchConfig(
            total_gib=args.total_gib, width=args.width, repeats=args.repeats, root=root, timeout_s=args.timeout_s
        )
        run(cfg)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
