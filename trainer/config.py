"""The run configuration: one validated dataclass per section, loaded from a TOML recipe.

A recipe (``configs/tiny.toml``) has the sections ``[run]``, ``[parallel]``, ``[model]``, ``[data]``,
``[optim]``, ``[checkpoint]``, ``[replica]``, ``[recovery]`` and ``[metrics]``; the command line
overrides single keys with ``--set key=value``, the value read as a TOML literal (``--set
parallel.tp=1 --set data.log_samples=true``; a value that is not a TOML literal, like ``--set
run.dir=/tmp/x``, is taken as a string). An unknown section or
key, or a value of the wrong type or range, raises ConfigError naming the key and what is allowed,
before any process group or file exists.

Sections reuse the components' own configs (``ParallelConfig``, ``ModelConfig``, ``DataConfig``);
the model's input sizes (``vocab_size``, ``audio_dim``, ``video_dim``, ``max_positions``) follow from
the data section unless the recipe sets them.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from resilient.errors import ConfigError
from resilient.recovery.config import QuorumConfig, RecoveryConfig, check_rows_divisible
from resilient.runfiles import default_ckpt_url
from resilient.storage.url import parse_url
from resilient.trainer.data.config import DataConfig
from resilient.trainer.model.config import ModelConfig
from resilient.trainer.parallel_config import ParallelConfig, check_model_compatible
from resilient.validate import check_bool, check_choice, check_int, check_number


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """What to run, for how long, and where its outputs go."""

    dir: str = "runs/default"
    """Run directory: metrics and samples under ``<dir>/group<G>/``, checkpoints under ``<dir>/ckpt``."""
    steps: int = 100
    """Train until this many optimizer steps are committed (a resumed run counts from its checkpoint)."""
    seed: int = 0
    """Seeds the model init (identical on every rank) and the torch/python/numpy RNGs; [0, 2**31)."""
    log_every: int = 10
    """Print a progress line every this many steps (metrics.jsonl gets every step); >= 1."""
    peak_flops: float = 0.0
    """Peak FLOP/s of ONE rank's device, the MFU denominator. 0: from the table of known GPUs
    (``trainer/peak.py``), else measured at startup with a short matmul; both MFU and the peak used
    are recorded in ``metrics.jsonl``."""
    hang_timeout_s: float = 600.0
    """No step completed for this long: every rank writes its threads' stacks to
    ``group<G>/hang/`` and a ``hang`` event (0: no watchdog). Restores and the final save are exempt."""
    device: str = "auto"
    """'cpu', 'cuda', or 'auto' (cuda when available); collectives use gloo on cpu, nccl on cuda."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective of the process group (a hung peer fails the job after it)."""
    step_hooks: list[str] = field(default_factory=list)
    """Import paths 'package.module:factory'; each factory(trainer) returns a callable(step, trainer)
    run after every committed step (fault injection, custom logging), or None."""

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise ConfigError(f"run.dir={self.dir!r} must be a non-empty path")
        check_int("run.steps", self.steps, 0)
        check_int("run.seed", self.seed, 0, 2**31 - 1)
        check_int("run.log_every", self.log_every, 1)
        check_number("run.peak_flops", self.peak_flops, 0.0, 1e20)
        check_number("run.hang_timeout_s", self.hang_timeout_s, 0.0, 7 * 86400.0)
        if 0 < self.hang_timeout_s < 1:
            raise ConfigError(f"run.hang_timeout_s={self.hang_timeout_s} is below 1 s: use 0 (off) or >= 1")
        check_choice("run.device", self.device, ("auto", "cpu", "cuda"))
        check_number("run.collective_timeout_s", self.collective_timeout_s, 1.0, 86400.0)
        if not isinstance(self.step_hooks, list) or not all(isinstance(h, str) and ":" in h for h in self.step_hooks):
            raise ConfigError(f"run.step_hooks={self.step_hooks!r} must be a list of 'package.module:factory'")


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """What the trainer measures beyond ``metrics.jsonl`` (docs/observability.md)."""

    rank_every: int = 5
    """Every this many steps rank 0 gathers each rank's step time by phase, stalled time and arrival
    time into ``group<G>/ranks.jsonl`` (one small all-gather); 0: never (no straggler detection
    either, and no stall clock)."""
    straggler_factor: float = 1.5
    """A rank is slow in a phase when its time there is this many times the median of its peers."""
    straggler_windows: int = 2
    """... for this many consecutive ``rank_every`` windows: then a ``straggler`` event and one
    warning; as many windows slow in nothing end the episode (``straggler_cleared``). With the
    defaults a rank held from outside is named within 10 steps."""
    tensorboard: bool = False
    """Also write each step's metrics as TensorBoard scalars under ``group<G>/tensorboard/``
    (``metrics.jsonl`` stays the source of truth)."""

    def __post_init__(self) -> None:
        check_int("metrics.rank_every", self.rank_every, 0)
        check_number("metrics.straggler_factor", self.straggler_factor, 1.0, 1000.0, open_low=True)
        check_int("metrics.straggler_windows", self.straggler_windows, 1, 10000)
        check_bool("metrics.tensorboard", self.tensorboard)


@dataclass(kw_only=True, slots=True)
class DataSection:
    """The ``[data]`` section: the pipeline's settings plus what the trainer logs about them.

    Kept apart from DataConfig because every DataConfig field but a few is hashed into the data
    state's fingerprint: a logging switch there would make a resume with logging on refuse a
    checkpoint written with it off.
    """

    pipeline: DataConfig = field(default_factory=DataConfig)
    """The data pipeline (keys ``data.seed``, ``data.row_len``, ``data.global_rows``, ...)."""
    log_samples: bool = False
    """Write ``samples.jsonl``: the sample ids the whole job consumed at each committed step."""

    def __post_init__(self) -> None:
        check_bool("data.log_samples", self.log_samples)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay (LambdaLR), and gradient-norm clipping."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup; (0, 10]."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW); [0, 10]."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """Adam's epsilon; (0, 1]."""
    warmup_steps: int = 10
    """Steps of linear warmup from lr/warmup_steps to lr; >= 0."""
    decay_steps: int = 0
    """Step at which the cosine reaches min_lr (constant after). 0: run.steps. Set it explicitly when
    a run is stopped and extended (a different run.steps would otherwise change the schedule)."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine as a fraction of lr; [0, 1]."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping); >= 0."""

    def __post_init__(self) -> None:
        check_number("optim.lr", self.lr, 0.0, 10.0, open_low=True)
        check_number("optim.weight_decay", self.weight_decay, 0.0, 10.0)
        if not isinstance(self.betas, list | tuple) or len(self.betas) != 2:
            raise ConfigError(f"optim.betas={self.betas!r} must be a list of two numbers in [0, 1)")
        for i, beta in enumerate(self.betas):
            check_number(f"optim.betas[{i}]", beta, 0.0, 0.999999)
        self.betas = [float(b) for b in self.betas]
        check_number("optim.eps", self.eps, 0.0, 1.0, open_low=True)
        check_int("optim.warmup_steps", self.warmup_steps, 0)
        check_int("optim.decay_steps", self.decay_steps, 0)
        check_number("optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_number("optim.grad_clip", self.grad_clip, 0.0, 1e9)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Persistent checkpoints through ``resilient.Checkpointer``."""

    url: str = ""
    """Checkpoint root: a path, file://, s3:// or memory:// URL. Empty: ``<run.dir>/ckpt``."""
    persist_every: int = 50
    """Save every this many steps, and always at the end; >= 1."""
    keep_last: int = 3
    """Committed steps to keep (older ones are deleted after a newer commit); 0 keeps all."""
    resume: bool = True
    """Start from the newest committed step under ``url`` when there is one."""
    writer: str = "thread"
    """Background persist in a 'thread' or a spawned 'process' (see CheckpointerConfig.writer)."""
    if_busy: str = "wait"
    """A save due while the previous one still persists: 'wait' for it, or 'skip' this one (the
    final save always waits)."""
    timeout_s: float = 1800.0
    """Longest wait for one save to commit, and for the saves in flight at the end of the run."""
    memory_every: int = 0
    """RAM tier: snapshot into the node-local store every this many steps (0: off); see [recovery]."""
    memory_keep: int = 2
    """RAM snapshots each rank keeps in its node store (and its buddy keeps of it); >= 1."""
    load_step: int | None = None
    """Resume from this committed step instead of the newest (unset: the newest that loads). RAM
    snapshots of later steps are not used and never come back (a new timeline). Must name a
    committed step under ``url`` with none after it (those would be saved again); applies once: a
    restart with the same value goes on from where the rewound run got to."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigError(f"checkpoint.url={self.url!r} must be a string (a path or a URL)")
        check_int("checkpoint.persist_every", self.persist_every, 1)
        check_int("checkpoint.keep_last", self.keep_last, 0)
        check_bool("checkpoint.resume", self.resume)
        check_choice("checkpoint.writer", self.writer, ("thread", "process"))
        check_choice("checkpoint.if_busy", self.if_busy, ("wait", "skip"))
        check_number("checkpoint.timeout_s", self.timeout_s, 1.0, 7 * 86400.0)
        check_int("checkpoint.memory_every", self.memory_every, 0)
        check_int("checkpoint.memory_keep", self.memory_keep, 1, 1000)
        if self.load_step is not None:
            check_int("checkpoint.load_step", self.load_step, 0)
            if not self.resume:
                raise ConfigError(
                    f"checkpoint.load_step={self.load_step} needs checkpoint.resume=true (resume off starts "
                    f"at step 0): unset one of them"
                )


# Model fields that the data fixes: the model must accept every token the pipeline produces.
_FROM_DATA = {
    "vocab_size": lambda d: d.vocab_size,
    "audio_dim": lambda d: d.audio_dim,
    "video_dim": lambda d: d.video_dim,
    "max_positions": lambda d: d.max_positions,
}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """A whole run. Build it with :func:`load_config` (recipe + overrides) or :func:`config_from_dict`."""

    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    replica: QuorumConfig = field(default_factory=QuorumConfig)
    """Replica groups under a torchft quorum (``resilient.recovery``); off by default."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """The RAM tier's node stores and buddy replication (``checkpoint.memory_every`` turns it on)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Per-rank step breakdown and straggler detection."""

    def __post_init__(self) -> None:
        data, model = self.data.pipeline, self.model
        for name in ("audio_dim", "video_dim"):
            if getattr(model, name) != getattr(data, name):
                raise ConfigError(
                    f"model.{name}={getattr(model, name)} must equal the data's {name}={getattr(data, name)}: "
                    f"leave model.{name} unset to take it from [data]"
                )
        if model.vocab_size < data.vocab_size:
            raise ConfigError(f"model.vocab_size={model.vocab_size} must be >= data.vocab_size={data.vocab_size}")
        if model.max_positions < data.max_positions:
            raise ConfigError(
                f"model.max_positions={model.max_positions} must be >= {data.max_positions}, the largest "
                "temporal position the data produces (+1)"
            )
        try:
            check_model_compatible(self.parallel, model)
        except ConfigError as e:
            raise ConfigError(f"parallel.tp does not fit the model: {e}") from e
        if data.global_rows % self.parallel.dp_shard:
            divisors = [d for d in range(1, data.global_rows + 1) if data.global_rows % d == 0]
            raise ConfigError(
                f"parallel.dp_shard={self.parallel.dp_shard} must divide data.global_rows={data.global_rows} "
                f"(each data-parallel rank takes an equal share of a global batch): use one of {divisors}"
            )
        if self.replica.enabled:
            check_rows_divisible(data.global_rows, self.parallel.dp_shard, self.replica.groups)
        self._check_pipeline_and_sequence()
        if not self.checkpoint.url:
            self.checkpoint.url = default_ckpt_url(self.run.dir)
        try:  # a wrong scheme or bucket is known here, before any worker starts
            parse_url(self.checkpoint.url)
        except ConfigError as e:
            raise ConfigError(f"checkpoint.url: {e}") from e

    def _check_pipeline_and_sequence(self) -> None:
        """The [parallel] keys that depend on the model and the data: a stage per block at least,
        microbatches that split every row count a rank may take, sequence slices of equal length.
        (pp_schedule and pp_microbatches are ignored at pp=1, so a pipelined recipe resumes on
        pp=1 by overriding pp alone.)"""
        p, data = self.parallel, self.data.pipeline
        if p.num_stages > self.model.n_layers:
            raise ConfigError(
                f"parallel.pp={p.pp} with pp_schedule={p.pp_schedule!r} makes {p.num_stages} pipeline stages "
                f"but model.n_layers={self.model.n_layers}: every stage needs a transformer block; lower "
                "parallel.pp, use pp_schedule='1F1B', or raise model.n_layers"
            )
        # Replica groups split a step's rows over the groups taking part: every count may occur.
        groups = self.replica.groups if self.replica.enabled else 1
        rows_by_groups = {k: data.global_rows // (p.dp_shard * k) for k in range(1, groups + 1)}
        if p.pp > 1 and p.microbatches < p.pp:
            raise ConfigError(
                f"parallel.pp_microbatches={p.microbatches} must be >= parallel.pp={p.pp}: the schedule keeps "
                "every stage busy with a microbatch of its own (pp_microbatches=0 means 2 x pp)"
            )
        bad = {k: rows for k, rows in rows_by_groups.items() if rows % p.microbatches}
        if p.pp > 1 and bad:
            k, rows = next(iter(bad.items()))
            step = p.pp if p.pp_schedule == "interleaved1F1B" else 1
            fits = [
                m
                for m in range(p.pp, min(rows_by_groups.values()) + 1, step)
                if all(r % m == 0 for r in rows_by_groups.values())
            ]
            shared = f" shared by {k} replica group(s)" if self.replica.enabled else ""
            multiple = p.microbatches * p.dp_shard * math.lcm(*range(1, groups + 1))
            advice = f"use one of {fits}" if fits else f"raise data.global_rows to a multiple of {multiple}"
            raise ConfigError(
                f"parallel.pp_microbatches={p.microbatches} must divide the {rows} rows a data-parallel rank "
                f"takes per step (data.global_rows={data.global_rows} / parallel.dp_shard={p.dp_shard}{shared}): "
                f"{advice}"
            )
        if p.pp > 1 and p.pp_schedule == "interleaved1F1B" and p.microbatches % p.pp:
            raise ConfigError(
                f"parallel.pp_microbatches={p.microbatches} must be a multiple of parallel.pp={p.pp} under "
                "pp_schedule='interleaved1F1B' (its rounds run pp microbatches at a time)"
            )
        if p.sequence_parallel and data.row_len % p.tp:
            raise ConfigError(
                f"parallel.sequence_parallel needs parallel.tp={p.tp} to divide data.row_len={data.row_len} "
                "(each tensor-parallel rank holds an equal slice of every row)"
            )

    @property
    def decay_steps(self) -> int:
        """The cosine's horizon: optim.decay_steps, else run.steps."""
        return self.optim.decay_steps or self.run.steps

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON values, in the recipe's key layout."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}
        out["data"] = {**out["data"].pop("pipeline"), **out["data"]}
        return out


_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "parallel": ParallelConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "replica": QuorumConfig,
    "recovery": RecoveryConfig,
    "metrics": MetricsConfig,
}
_DATA_SECTION_KEYS = ("log_samples",)


def allowed_keys(section: str) -> list[str]:
    """The keys a recipe may set in ``section``."""
    names = [f.name for f in dataclasses.fields(_SECTIONS[section])]
    return names + list(_DATA_SECTION_KEYS) if section == "data" else names


def _coerce(section: str, cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """Check keys against the dataclass and normalize numbers, so '1' and '1.0' mean the same float
    (the data fingerprint hashes the values: 1 and 1.0 would be different streams)."""
    allowed = allowed_keys(section)
    out = {}
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in allowed:
            raise ConfigError(f"unknown key {section}.{key}; allowed keys in [{section}]: {sorted(allowed)}")
        default = defaults.get(key)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{section}.{key}={value!r} must be true or false")
        elif isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"{section}.{key}={value!r} must be a string")
        out[key] = value
    return out


def _build_section(section: str, values: dict[str, Any], data: DataConfig | None = None) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table of keys, got {values!r}")
    cls = _SECTIONS[section]
    values = _coerce(section, cls, values)
    if section == "model" and data is not None:
        values = {**{k: derive(data) for k, derive in _FROM_DATA.items()}, **values}
    extra = {k: values.pop(k) for k in _DATA_SECTION_KEYS if section == "data" and k in values}
    try:
        built = cls(**values)
    except ConfigError as e:
        raise ConfigError(f"[{section}] {e}") from e
    except TypeError as e:  # a wrong type that the section's own checks did not catch
        raise ConfigError(f"[{section}] {e}; allowed keys: {sorted(allowed_keys(section))}") from e
    return DataSection(pipeline=built, **extra) if section == "data" else built


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from a recipe's tables (missing sections and keys take defaults)."""
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config section(s) {unknown}; allowed: {list(_SECTIONS)}")
    data = _build_section("data", raw.get("data", {}))
    if data.pipeline.source == "shards":  # the build is read here: a wrong DEST fails before any worker
        from resilient.trainer.data.shard_source import resolve_build

        given = raw.get("data", {}) if isinstance(raw.get("data"), dict) else {}
        data.pipeline = resolve_build(data.pipeline, vocab_given="vocab_size" in given)
    sections = {name: _build_section(name, raw.get(name, {}), data.pipeline) for name in _SECTIONS if name != "data"}
    return TrainConfig(data=data, **sections)


def parse_override(item: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section', 'key'], value parsed as a TOML literal, else the string)."""
    key, sep, text = item.partition("=")
    path = key.strip().split(".")
    if not sep or len(path) != 2 or not all(path):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set parallel.tp=2")
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # a bare path or word: TOML would need it quoted, the shell makes that awkward
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """``raw`` with every 'section.key=value' applied (later ones win)."""
    merged = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    for item in overrides:
        (section, key), value = parse_override(item)
        if section not in _SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}; allowed: {list(_SECTIONS)}")
        merged.setdefault(section, {})[key] = value
    return merged


def load_config(path: str | None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Read a TOML recipe (None: all defaults), apply ``--set`` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path!r} does not exist") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path!r} is not UTF-8 text (TOML must be): {e.reason}") from e
        except OSError as e:  # a directory, no permission, an I/O error
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror or e}") from e
    try:
        return config_from_dict(apply_overrides(raw, overrides))
    except ConfigError as e:
        where = f" (recipe {path})" if path else ""
        raise ConfigError(f"{e}{where}") from e
