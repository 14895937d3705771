"""Objects per step and the many-small-tensors case on several ranks and on S3: ours against DCP.

Two cases, each in ONE run with both implementations alternating:

- ``objects``: a world of ``--objects-world`` gloo ranks holds 8 matrices and N small vectors, all
  FSDP-style ``Shard(0)`` DTensors (N = each of ``--objects-tensors``, 200 and 2,000 by default,
  ``--small-kib`` KiB each before sharding). Each implementation saves the state to a local
  directory; the step's files are counted (every object: data, metadata, receipts, manifest). With
  the largest N, each round also times both saves (durable: fsync on both sides) and both loads.
- ``s3``: one process, ``--small-tensors`` tensors of ``--small-kib`` KiB, saved to and loaded from a
  loopback S3 endpoint (moto) by us and by DCP through AWS's plugin (``s3torchconnector``'s
  ``S3StorageWriter``/``S3StorageReader``, path-style addressing); objects counted by listing.

Each case ends with retention's requests per commit at 20 and 100 kept steps, on the disk and on
the same moto server (``bench_retention.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from bench_common import alternate, emit, ratio_line, result_line, run_world, timed, timed_save_resilient
from bench_retention import run_retention

log = logging.getLogger("ckpt_bench.packed")
MATRIX = (512, 256)
RETENTION_KEPT, RETENTION_COMMITS = [20, 100], 5  # kept steps before a measured commit; commits measured


@dataclass(kw_only=True, slots=True)
class PackedConfig:
    tensors: list[int] = field(default_factory=lambda: [200, 2000])
    """Small-tensor counts of the objects case; the largest is also timed."""
    world: int = 4
    kib: int = 16
    repeats: int = 2
    root: str = ""
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.tensors or any(not 1 <= n <= 100_000 for n in self.tensors):
            raise ValueError(f"objects tensors must be in [1, 100000], got {self.tensors}")
        if not 1 <= self.world <= 16:
            raise ValueError(f"objects world must be in [1, 16], got {self.world}")


def _count_files(path: str) -> int:
    return sum(len(names) for _, _, names in os.walk(path))


def _state(count: int, kib: int, mesh: Any) -> dict:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    numel = kib * 1024 // 4
    flat = {f"layers.{i}.w": torch.randn(*MATRIX, generator=gen) for i in range(8)}
    flat |= {f"layers.{i // 2}.{('norm', 'bias')[i % 2]}": torch.randn(numel, generator=gen) for i in range(count)}
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in flat.items()}}


def objects_world(rank: int, world: int, cfg: PackedConfig, count: int, timed_rounds: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from resilient import Checkpointer
    from resilient.manifest import step_dir

    mesh = init_device_mesh("cpu", (world,))
    state = _state(count, cfg.kib, mesh)
    dest = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    root = os.path.join(cfg.root, f"objects-{count}")
    times: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    with Checkpointer(os.path.join(root, "resilient")) as ckpt:
        for step in range(timed_rounds + 1):  # round 0: the untimed warm-up, and the counted one
            dcp_dir = os.path.join(root, f"dcp-{step}")
            seconds = {}
            for impl in alternate(step, "resilient", "dcp"):
                if impl == "resilient":
                    seconds["save_resilient"] = timed_save_resilient(ckpt, state, step, timeout_s=cfg.timeout_s)[1]
                else:
                    writer = dcp.FileSystemWriter(dcp_dir, sync_files=True)
                    seconds["save_dcp"] = timed(lambda w=writer: dcp.save(state, storage_writer=w))
            if step == 0 and rank == 0:
                counts = {
                    "resilient": _count_files(os.path.join(root, "resilient", step_dir(0))) + 1,  # + latest
                    "dcp": _count_files(dcp_dir),
                }
            for impl in alternate(step, "resilient", "dcp"):
                for t in dest["model"].values():
                    t.to_local().zero_()
                if impl == "resilient":
                    seconds["load_resilient"] = timed(lambda s=step: ckpt.load(dest, step=s))
                else:
                    reader = dcp.FileSystemReader(dcp_dir)
                    seconds["load_dcp"] = timed(lambda r=reader: dcp.load(dest, storage_reader=r))
                got = dest["model"]
                bad = [k for k, v in state["model"].items() if not torch.equal(got[k].to_local(), v.to_local())]
                if bad:
                    raise AssertionError(f"{impl} load of step {step}: {len(bad)} tensors differ (e.g. {bad[:3]})")
            if step > 0:
                for name, value in seconds.items():
                    times.setdefault(name, []).append(value)
                shutil.rmtree(os.path.join(root, "resilient", step_dir(step - 1)), ignore_errors=True)
            shutil.rmtree(os.path.join(root, f"dcp-{step - 1}"), ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    return {"counts": counts, "seconds": times, "bytes": nbytes}


def run_objects(cfg: PackedConfig) -> None:
    biggest = max(cfg.tensors)
    for count in sorted(cfg.tensors):
        rounds = cfg.repeats if count == biggest else 0
        log.info("objects: %d ranks, 8 matrices + %d small tensors (%d timed rounds)", cfg.world, count, rounds)
        result = run_world(objects_world, cfg.world, cfg, count, rounds)[0]
        lines = {}
        for impl, n in result["counts"].items():
            lines[impl] = {
                "bench": "objects_per_step",
                "impl": impl,
                "tensors": count + 8,
                "world": cfg.world,
                "objects": n,
                "limit": 4 * cfg.world + 16 if impl == "resilient" else None,
            }
            emit(lines[impl])
        emit(
            {
                "bench": "ratio",
                "name": f"objects_{count}_resilient_over_dcp",
                "value": round(lines["resilient"]["objects"] / lines["dcp"]["objects"], 3),
            }
        )
        if rounds:
            _emit_times(result, cfg.world, count)
    run_retention(RETENTION_KEPT, RETENTION_COMMITS, s3=False)  # requests, not files: a few seconds


def _emit_times(result: dict, world: int, count: int) -> None:
    seconds, nbytes = result["seconds"], result["bytes"]
    lines = {}
    for op in ("save", "load"):
        for impl in ("resilient", "dcp"):
            times = seconds[f"{op}_{impl}"]
            line = result_line(f"{op}_small_sharded", impl, nbytes, times, from_world=world, to_world=world)
            lines[(op, impl)] = {**line, "tensors": count + 8}
            emit(lines[(op, impl)])
    for op in ("save", "load"):
        emit(ratio_line(f"{op}_small_sharded_resilient_over_dcp", lines[(op, "resilient")], lines[(op, "dcp")]))


# ---------------------------------------------------------------------------------------------
# S3: ours against DCP through s3torchconnector


@dataclass(kw_only=True, slots=True)
class S3SmallConfig:
    tensors: int = 2000
    kib: int = 16
    repeats: int = 2
    timeout_s: float = 1800.0


def _list(client: Any, bucket: str, prefix: str) -> list[str]:
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def s3_small_world(rank: int, world: int, cfg: S3SmallConfig) -> dict:
    import boto3
    import torch
    import torch.distributed.checkpoint as dcp
    from bench_small import SmallConfig, small_state
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    from resilient import Checkpointer

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = small_state(SmallConfig(tensors=cfg.tensors, kib=cfg.kib))
    dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket="packed")
    s3cfg = S3ClientConfig(force_path_style=True)
    times: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    with Checkpointer("s3://packed/ours") as ckpt:
        for step in range(cfg.repeats + 1):
            seconds = {}
            for impl in alternate(step, "resilient", "dcp"):
                if impl == "resilient":
                    seconds["save_resilient"] = timed_save_resilient(ckpt, state, step, timeout_s=cfg.timeout_s)[1]
                else:
                    writer = S3StorageWriter(region="us-east-1", path=f"s3://packed/dcp-{step}", s3client_config=s3cfg)
                    seconds["save_dcp"] = timed(lambda w=writer: dcp.save(state, storage_writer=w, no_dist=True))
            if step == 0:
                counts = {
                    "resilient": len(_list(client, "packed", "ours/step-000000000/")) + 1,  # + latest
                    "dcp": len(_list(client, "packed", "dcp-0/")),
                }
            for impl in alternate(step, "resilient", "dcp"):
                for t in dest["model"].values():
                    t.zero_()
                if impl == "resilient":
                    seconds["load_resilient"] = timed(lambda s=step: ckpt.load(dest, step=s))
                else:
                    reader = S3StorageReader(region="us-east-1", path=f"s3://packed/dcp-{step}", s3client_config=s3cfg)
                    seconds["load_dcp"] = timed(lambda r=reader: dcp.load(dest, storage_reader=r, no_dist=True))
                bad = [k for k, v in state["model"].items() if not torch.equal(dest["model"][k], v)]
                if bad:
                    raise AssertionError(f"{impl} S3 load of step {step}: {len(bad)} tensors differ")
            if step > 0:
                for name, value in seconds.items():
                    times.setdefault(name, []).append(value)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    return {"counts": counts, "seconds": times, "bytes": nbytes}


def run_s3_small(cfg: S3SmallConfig) -> None:
    from bench_s3 import moto_server

    with moto_server():
        started = time.perf_counter()
        result = run_world(s3_small_world, 1, cfg, process_group=False)[0]
        log.info("s3 small case: %.1f s", time.perf_counter() - started)
        run_retention(RETENTION_KEPT, RETENTION_COMMITS, s3=True)
    for impl, n in result["counts"].items():
        emit({"bench": "objects_per_step_s3", "impl": impl, "tensors": cfg.tensors, "world": 1, "objects": n})
    lines = {}
    for op in ("save", "load"):
        for impl in ("resilient", "dcp_s3torchconnector"):
            key = "resilient" if impl == "resilient" else "dcp"
            times = result["seconds"][f"{op}_{key}"]
            line = result_line(f"{op}_small_s3", impl, result["bytes"], times, from_world=1, to_world=1)
            lines[(op, impl)] = {**line, "tensors": cfg.tensors}
            emit(lines[(op, impl)])
    for op in ("save", "load"):
        name = f"{op}_small_s3_resilient_over_dcp_s3torchconnector"
        emit(ratio_line(name, lines[(op, "resilient")], lines[(op, "dcp_s3torchconnector")]))
