"""Many small tensors: ``--small-tensors`` 1-D fp32 tensors of ``--small-kib`` KiB each (the norms and
biases of a deep model), saved durably and loaded back in ONE process, ours against DCP's.

No process group: our ``Checkpointer`` works without one, and DCP runs with ``no_dist=True``. What
this measures is the fixed cost per tensor (planning, one array and its metadata per tensor, the
commit), which the large FSDP case hides behind its bytes.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

from bench_common import (
    alternate,
    blocked_fields,
    emit,
    files_of,
    ratio_line,
    result_line,
    run_world,
    timed,
    timed_save_resilient,
    write_files_floor,
)

log = logging.getLogger("ckpt_bench.small")
_NAMES = ("norm.weight", "bias")


@dataclass(kw_only=True, slots=True)
class SmallConfig:
    tensors: int = 2000
    """How many tensors the state holds."""
    kib: int = 16
    """Size of each tensor in KiB (fp32, so kib * 256 elements)."""
    repeats: int = 2
    """Measured rounds, after one untimed warm-up round."""
    root: str = ""
    """Scratch directory for both implementations' checkpoints (removed with the run's scratch)."""
    timeout_s: float = 1800.0
    """Longest the process may run before it is killed (and each save's wait)."""

    def __post_init__(self) -> None:
        if not 1 <= self.tensors <= 1_000_000:
            raise ValueError(f"small tensors must be in [1, 1000000], got {self.tensors}")
        if not 1 <= self.kib <= 1 << 20:
            raise ValueError(f"small kib must be in [1, 1048576], got {self.kib}")
        if not 1 <= self.repeats <= 100:
            raise ValueError(f"repeats must be in [1, 100], got {self.repeats}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def resilient_root(self) -> str:
        return os.path.join(self.root, "resilient")

    def resilient_step_dir(self, step: int) -> str:
        from resilient.manifest import step_dir

        return os.path.join(self.resilient_root, step_dir(step))

    def dcp_dir(self, step: int) -> str:
        return os.path.join(self.root, f"dcp-step{step}")

    def raw_dir(self, step: int) -> str:
        return os.path.join(self.root, f"raw-step{step}")


# ---------------------------------------------------------------------------------------------
# the process (spawned, no process group)


def small_state(cfg: SmallConfig, seed: int = 0) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    numel = cfg.kib * 1024 // 4
    layers = {f"layers.{i // 2}.{_NAMES[i % 2]}": torch.randn(numel, generator=gen) for i in range(cfg.tensors)}
    return {"model": layers}


def _check_equal(got: dict, want: dict, what: str) -> None:
    import torch

    bad = [k for k, v in want["model"].items() if not torch.equal(got["model"][k], v)]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} loaded tensors differ from the saved ones (e.g. {bad[:3]})")


def _zero(state: dict) -> None:
    for t in state["model"].values():
        t.zero_()


def _save_dcp(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)


def _load_dcp(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def _round(cfg: SmallConfig, ckpt: Any, step: int, state: dict, dest: dict) -> dict[str, float]:
    """One save and one load of each implementation, in alternating order; loads verified."""
    seconds: dict[str, float] = {}
    for impl in alternate(step, "resilient", "dcp"):
        if impl == "resilient":
            blocked, total, _ = timed_save_resilient(ckpt, state, step, timeout_s=cfg.timeout_s)
            seconds["save_resilient_blocked"] = blocked
        else:
            total = timed(lambda: _save_dcp(state, cfg.dcp_dir(step)))
        seconds[f"save_{impl}"] = total
    # The format's floor: our step's entries (a directory, its zarr.json and its shard object per
    # tensor) with nothing of ours around them.
    files = files_of(cfg.resilient_step_dir(step))
    payload = memoryview(bytearray(max((size for _, size in files), default=1)))
    seconds["save_raw_entries"] = timed(lambda: write_files_floor(cfg.raw_dir(step), files, payload))
    for impl in alternate(step, "resilient", "dcp"):
        _zero(dest)
        if impl == "resilient":
            seconds["load_resilient"] = timed(lambda: ckpt.load(dest, step=step))
        else:
            seconds["load_dcp"] = timed(lambda: _load_dcp(dest, cfg.dcp_dir(step)))
        _check_equal(dest, state, f"{impl} small load of step {step}")
    log.info("small round %d: %s", step, {k: round(v, 3) for k, v in seconds.items()})
    return seconds


def small_world(rank: int, world: int, cfg: SmallConfig) -> dict:
    import torch

    from resilient import Checkpointer

    # DCP warns that it runs without a process group, which is the point here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = small_state(cfg)
    dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    times: dict[str, list[float]] = {}
    with Checkpointer(cfg.resilient_root) as ckpt:
        for step in range(cfg.repeats + 1):  # step 0: the untimed warm-up
            seconds = _round(cfg, ckpt, step, state, dest)
            if step > 0:
                for name, value in seconds.items():
                    times.setdefault(name, []).append(value)
                shutil.rmtree(cfg.resilient_step_dir(step - 1), ignore_errors=True)
                shutil.rmtree(cfg.dcp_dir(step - 1), ignore_errors=True)
                shutil.rmtree(cfg.raw_dir(step - 1), ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    return {"bytes": nbytes, "seconds": times}


# ---------------------------------------------------------------------------------------------
# the parent


def run_small(cfg: SmallConfig) -> None:
    """Run the case in one spawned process and print its result and ratio lines."""
    log.info("small tensors: %d x %d KiB in one process", cfg.tensors, cfg.kib)
    result = run_world(small_world, 1, cfg, process_group=False)[0]
    nbytes, seconds = result["bytes"], result["seconds"]
    shape = {"tensors": cfg.tensors, "tensor_bytes": cfg.kib * 1024}
    lines = {}
    for op in ("save", "load"):
        for impl in ("resilient", "dcp"):
            line = result_line(f"{op}_small", impl, nbytes, seconds[f"{op}_{impl}"], from_world=1, to_world=1)
            lines[f"{op}_{impl}"] = {**line, **shape}
    raw = result_line("save_small", "raw_entries", nbytes, seconds["save_raw_entries"], from_world=1, to_world=1)
    lines["save_raw_entries"] = {**raw, **shape}
    lines["save_resilient"].update(blocked_fields(seconds["save_resilient_blocked"]))
    for line in lines.values():
        emit(line)
    for op in ("save", "load"):
        emit(ratio_line(f"{op}_small_resilient_over_dcp", lines[f"{op}_resilient"], lines[f"{op}_dcp"]))
    # How close our save is to the floor of the format on this file system, and how far that floor
    # itself is from DCP (one file per rank): the part no code change short of a new layout removes.
    emit(ratio_line("save_small_resilient_over_raw_entries", lines["save_resilient"], lines["save_raw_entries"]))
    emit(ratio_line("save_small_raw_entries_over_dcp", lines["save_raw_entries"], lines["save_dcp"]))
