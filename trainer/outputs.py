"""What a run writes besides checkpoints: ``<run.dir>/group<G>/{metrics,samples}.jsonl`` and a
progress line, from the group's rank 0 only.

Both files are appended to, one JSON object per line, flushed per line: a resumed run continues
them, and a step redone after a restore appears twice, the later line being the one that counts
(readers: :func:`read_jsonl_by_step`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import IO, Any

from resilient.errors import ConfigError

GROUP_ENV = "RESILIENT_GROUP"
"""Replica-group id of this torchrun job (0 while a run has one group)."""


def group_id() -> int:
    value = os.environ.get(GROUP_ENV, "0")
    if not value.isdigit():
        raise ConfigError(f"environment {GROUP_ENV}={value!r} must be a non-negative integer (replica group id)")
    return int(value)


def group_dir(run_dir: str, group: int | None = None) -> str:
    """Where one replica group's metrics and samples go."""
    return os.path.join(os.path.abspath(run_dir), f"group{group_id() if group is None else group}")


@dataclass(slots=True)
class StepStats:
    """One line of metrics.jsonl: a committed step, as the whole group saw it."""

    step: int
    loss: float
    """Global mean loss (text cross-entropy + weighted next-frame MSE) over every loss token."""
    text_loss: float
    """Global mean cross-entropy per text target."""
    tokens: int
    """Token slots the group processed (global_rows x row_len, padding included: it is computed)."""
    loss_tokens: int
    """Positions that contributed to the loss, all data-parallel ranks together."""
    lr: float
    grad_norm: float
    """Global gradient norm before clipping."""
    step_time_s: float
    """Wall time of the whole step: data wait + compute + checkpoint stall."""
    data_wait_s: float
    """Time spent waiting for this step's batch (0 when the loader kept ahead)."""
    ckpt_stall_s: float
    """Time the step was blocked by checkpointing (save snapshot, or waiting for an earlier save)."""
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilization: flops_per_token x tokens / step_time / (peak_flops x ranks)."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("loss", "text_loss", "grad_norm"):
            out[key] = float(out[key])  # full precision: bit-identity tests compare these
        for key in ("step_time_s", "data_wait_s", "ckpt_stall_s"):
            out[key] = round(out[key], 6)
        out["tokens_per_s"] = round(out["tokens_per_s"], 1)
        out["mfu"] = round(out["mfu"], 6)
        return out


class RunOutputs:
    """Rank 0's writer of metrics.jsonl, samples.jsonl and the progress line (a no-op elsewhere)."""

    def __init__(self, directory: str, *, enabled: bool, log_samples: bool, log_every: int, steps: int) -> None:
        self.directory = directory
        self.enabled = enabled
        self.log_every = log_every
        self.steps = steps
        self._metrics: IO[str] | None = None
        self._samples: IO[str] | None = None
        if enabled:
            os.makedirs(directory, exist_ok=True)
            self._metrics = open(os.path.join(directory, "metrics.jsonl"), "a")  # noqa: SIM115 (closed in close())
            if log_samples:
                self._samples = open(os.path.join(directory, "samples.jsonl"), "a")  # noqa: SIM115

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.directory, "metrics.jsonl")

    @property
    def samples_path(self) -> str:
        return os.path.join(self.directory, "samples.jsonl")

    def write_config(self, config: dict[str, Any], extra: dict[str, Any]) -> None:
        """config.json: the resolved config of the latest start (and where/how it ran)."""
        if self.enabled:
            with open(os.path.join(self.directory, "config.json"), "w") as f:
                json.dump({**config, "launch": extra}, f, indent=2)

    def step(self, stats: StepStats) -> None:
        if not self.enabled:
            return
        _write_line(self._metrics, stats.to_json())
        if stats.step % self.log_every == 0 or stats.step == self.steps:
            print(
                f"step {stats.step:>6}/{self.steps} | loss {stats.loss:.4f} | lr {stats.lr:.2e} | "
                f"{stats.step_time_s * 1e3:7.1f} ms/step | {stats.tokens_per_s:9.0f} tok/s | "
                f"data wait {stats.data_wait_s * 1e3:5.1f} ms | mfu {stats.mfu:.2%}",
                flush=True,
            )

    def samples(self, step: int, sample_ids: list[str]) -> None:
        if self._samples is not None:
            _write_line(self._samples, {"step": step, "sample_ids": sample_ids})

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        for f in (self._metrics, self._samples):
            if f is not None:
                f.close()
        self._metrics = self._samples = None


def _write_line(f: IO[str] | None, record: dict[str, Any]) -> None:
    if f is not None:
        f.write(json.dumps(record) + "\n")
        f.flush()  # a killed run keeps every line it logged


def read_jsonl_by_step(path: str) -> dict[int, dict[str, Any]]:
    """Records of a metrics/samples file keyed by step; a step logged twice keeps its last line.

    A torn last line (the writer was killed mid-write) is skipped.
    """
    out: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[record["step"]] = record
    return dict(sorted(out.items()))


def sort_sample_ids(ids: set[str]) -> list[str]:
    """'<epoch>:<index>' ids in (epoch, index) order."""
    return sorted(ids, key=lambda s: tuple(int(p) for p in s.split(":")))
