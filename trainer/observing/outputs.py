"""What a run writes besides checkpoints: ``<run.dir>/group<G>/{metrics,samples}.jsonl`` and a
progress line, from the group's rank 0 only (paths and the line format: ``resilient.runfiles``).

Both files are appended to, one JSON object per line in one write: a resumed run continues them,
and a step redone after a restore appears twice, the later line being the one that counts
(readers: :func:`resilient.runfiles.read_jsonl_by_step`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from resilient.runfiles import CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, SKIPPED_FILE, append_jsonl

log = logging.getLogger(__name__)


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
    data_skipped: int
    """Documents of the global batch that could not be built (``skipped.jsonl`` names them)."""
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilization: flops_per_token x tokens / step_time / (peak_flops x ranks)."""
    peak_flops: float
    """FLOP/s of one rank's device the MFU is relative to (``trainer/observing/peak.py``)."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("loss", "text_loss", "grad_norm"):
            out[key] = float(out[key])  # full precision: bit-identity tests compare these
        for key in ("step_time_s", "data_wait_s", "ckpt_stall_s"):
            out[key] = round(out[key], 6)
        out["tokens_per_s"] = round(out["tokens_per_s"], 1)
        out["mfu"] = round(out["mfu"], 6)
        return out


TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_SCALARS = (
    "loss",
    "text_loss",
    "lr",
    "grad_norm",
    "step_time_s",
    "data_wait_s",
    "ckpt_stall_s",
    "tokens_per_s",
    "mfu",
)


class RunOutputs:
    """Rank 0's writer of metrics.jsonl, samples.jsonl and the progress line (a no-op elsewhere)."""

    def __init__(self, directory: str, *, enabled: bool, log_samples: bool, log_every: int, steps: int) -> None:
        self.directory = directory
        self.enabled = enabled
        self.log_samples = log_samples
        self.log_every = log_every
        self.steps = steps
        self._failed: set[str] = set()  # files whose write failed (warned once each)
        self.context: dict[str, Any] = {}
        """Fields every metrics row carries (the layout: docs/observability.md)."""
        self.tensorboard: Any = None
        """A ``SummaryWriter`` each step's scalars also go to (``metrics.tensorboard``), or None."""
        if enabled:
            os.makedirs(directory, exist_ok=True)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.directory, METRICS_FILE)

    @property
    def samples_path(self) -> str:
        return os.path.join(self.directory, SAMPLES_FILE)

    def write_config(self, config: dict[str, Any], extra: dict[str, Any]) -> None:
        """config.json: the resolved config of the latest start (and where/how it ran)."""
        if self.enabled:
            with self._side_effect(CONFIG_FILE), open(os.path.join(self.directory, CONFIG_FILE), "w") as f:
                json.dump({**config, "launch": extra}, f, indent=2)

    def step(self, stats: StepStats) -> None:
        if not self.enabled:
            return
        with self._side_effect(METRICS_FILE):
            append_jsonl(self.metrics_path, {**stats.to_json(), **self.context})
        if self.tensorboard is not None:
            with self._side_effect(TENSORBOARD_DIR):
                for name in TENSORBOARD_SCALARS:
                    self.tensorboard.add_scalar(f"train/{name}", getattr(stats, name), stats.step)
        if stats.step % self.log_every == 0 or stats.step == self.steps:
            print(
                f"step {stats.step:>6}/{self.steps} | loss {stats.loss:.4f} | lr {stats.lr:.2e} | "
                f"{stats.step_time_s * 1e3:7.1f} ms/step | {stats.tokens_per_s:9.0f} tok/s | "
                f"data wait {stats.data_wait_s * 1e3:5.1f} ms | mfu {stats.mfu:.2%}",
                flush=True,
            )

    def samples(self, step: int, sample_ids: list[str]) -> None:
        if self.enabled and self.log_samples:
            with self._side_effect(SAMPLES_FILE):
                append_jsonl(self.samples_path, {"step": step, "sample_ids": sample_ids})

    def skipped(self, step: int, entries: list[dict[str, str]], *, rank: int) -> None:
        """``skipped.jsonl``: the documents of THIS rank's rows that could not be built. One rank
        per data-parallel share writes its own (one line each, one write: appends do not interleave)."""
        for entry in entries:
            with self._side_effect(SKIPPED_FILE):
                append_jsonl(os.path.join(self.directory, SKIPPED_FILE), {"step": step, "rank": rank, **entry})

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    @contextlib.contextmanager
    def _side_effect(self, name: str) -> Iterator[None]:
        """A write that must not stop training: only rank 0 writes these files, so an OSError
        raised here would leave every other rank waiting in the next collective. Warned once."""
        try:
            yield
        except OSError as e:
            if name not in self._failed:
                self._failed.add(name)
                log.warning("cannot write %s in %s (%s); training goes on without it", name, self.directory, e)

    def open_tensorboard(self) -> None:
        """Start the TensorBoard writer (rank 0; torch's writer, which needs the tensorboard package)."""
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter  # deferred: a heavy import, off by default

            self.tensorboard = SummaryWriter(os.path.join(self.directory, TENSORBOARD_DIR))

    def close(self) -> None:
        """Every JSON line is one append (nothing held open); the TensorBoard writer is flushed."""
        if self.tensorboard is not None:
            with self._side_effect(TENSORBOARD_DIR):
                self.tensorboard.close()
            self.tensorboard = None


def sort_sample_ids(ids: set[str]) -> list[str]:
    """'<epoch>:<index>' ids in (epoch, index) order; '<epoch>:<key>[#<window>]' ids of a shard
    build in (epoch, key, window) order."""
    return sorted(ids, key=_sample_order)


def _sample_order(sample_id: str) -> tuple[int, int, str, int]:
    epoch, _, name = sample_id.partition(":")
    if name.isdigit():
        return int(epoch), int(name), "", 0
    key, _, window = name.rpartition("#")
    if not window.isdigit():  # a sample that was not cut (its key may hold a '#')
        return int(epoch), -1, name, 0
    return int(epoch), -1, key, int(window)
