"""The data-pipeline state: a small JSON record from which the rest of the stream follows.

``{version, fingerprint, seed, epoch, rows_consumed}``: order and packing are pure functions of
the config, so (epoch, rows_consumed) is the whole cursor. The fingerprint hashes every setting
that changes the row stream; restoring under a different one would silently feed other data (or
the same data cut differently), so it is refused instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from typing import Any

from resilient.errors import RestoreError
from resilient.trainer.data.config import DataConfig
from resilient.trainer.data.stream import RowKey

DATA_STATE_VERSION = 1
"""Bump when the source, tokenizer or packer change what a config produces."""

_STATE_KEYS = ("version", "fingerprint", "seed", "epoch", "rows_consumed")
_NOT_IN_STREAM = ("global_rows", "num_workers", "prefetch_factor", "worker_timeout_s", "cache_dir", "cache_bytes")
"""Settings that change how rows are batched or fetched, never which rows come: a resume may change
them (global_rows included: the cursor counts rows, not steps)."""


_SHARDS_ONLY = ("source", "shards_fingerprint")
"""Hashed for real media only, so a synthetic run's fingerprint is what it was before they existed."""
_SYNTHETIC_ONLY = ("num_samples", "min_clip_seconds")
"""The generator's sizes: a build's samples and durations are in its fingerprint."""


def stream_settings(config: DataConfig) -> dict[str, Any]:
    """The settings the fingerprint hashes, with the state version. The build's location is not one
    of them (a copy of it elsewhere is the same stream); its fingerprint is."""
    skip = {*_NOT_IN_STREAM, "shards", *(_SYNTHETIC_ONLY if config.source == "shards" else _SHARDS_ONLY)}
    settings = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in skip}
    return {"version": DATA_STATE_VERSION, **settings}


def fingerprint(config: DataConfig) -> str:
    """16 hex digits of sha256 over the canonical JSON of stream_settings(config)."""
    canonical = json.dumps(stream_settings(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def make_state(config: DataConfig, cursor: RowKey) -> dict[str, Any]:
    """The JSON-able state of a pipeline whose next unconsumed row is cursor."""
    return {
        "version": DATA_STATE_VERSION,
        "fingerprint": fingerprint(config),
        "seed": config.seed,
        "epoch": cursor.epoch,
        "rows_consumed": cursor.row,
    }


def check_state(config: DataConfig, state: dict[str, Any]) -> RowKey:
    """The cursor stored in state, after checking the state belongs to this config's stream."""
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise RestoreError(
            f"data-pipeline state lacks {missing} (has {sorted(state)}): it was not written by "
            "OmniPipeline.state_dict(); restore the 'data' entry of the same checkpoint"
        )
    expected = fingerprint(config)
    if state["version"] != DATA_STATE_VERSION or state["fingerprint"] != expected:
        raise RestoreError(_mismatch_message(config, state, expected))
    for key in ("epoch", "rows_consumed"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RestoreError(f"data-pipeline state has {key}={value!r}; expected an int >= 0")
    return RowKey(state["epoch"], state["rows_consumed"])


def _mismatch_message(config: DataConfig, state: dict[str, Any], expected: str) -> str:
    differing = []
    if state["version"] != DATA_STATE_VERSION:
        differing.append(f"version: checkpoint {state['version']!r}, pipeline {DATA_STATE_VERSION}")
    if state["seed"] != config.seed:
        differing.append(f"seed: checkpoint {state['seed']!r}, pipeline {config.seed}")
    if not differing:
        # Only version and seed travel in the state; name the suspects with their current values.
        suspects = {k: v for k, v in stream_settings(config).items() if k not in ("version", "seed")}
        differing.append(f"one of these settings (pipeline values shown): {suspects}")
    return (
        f"data-pipeline fingerprint mismatch: checkpoint {state['fingerprint']!r}, pipeline "
        f"{expected!r}; differing: {'; '.join(differing)}. Resuming would feed a different stream: "
        "restore with the DataConfig the checkpoint was written with, or start the data stream "
        "afresh (do not load the data state)"
    )
