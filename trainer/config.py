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
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from resilient.errors import ConfigError
from resilient.recovery.config import RamTierConfig, ReplicaConfig, check_rows_divisible
from resilient.runfiles import default_ckpt_url
from resilient.storage.config import CheckpointerConfig
from resilient.storage.url import parse_url
from resilient.trainer.checkpoint_config import STORAGE_SET_BY_TRAINER, CheckpointConfig
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
    (``trainer/observing/peak.py``), else the model's own matmul shapes measured once per machine (cached,
    raised when a step does better: MFU stays <= 1); the peak and its source are in ``config.json``
    and ``metrics.jsonl``."""
    hang_timeout_s: float = 600.0
    """No step completed for this long: every rank writes its threads' stacks to
    ``group<G>/hang/`` and a ``hang`` event (0: no watchdog). Restores and the final save are exempt."""
    device: str = "auto"
    """'cpu', 'cuda', or 'auto' (cuda when available); collectives use gloo on cpu, nccl on cuda."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective of the process group (a hung peer fails the job after it)."""
    preempt_signal: str = ""
    """A signal that asks for a stop like SIGTERM does (saved, exit 143, resumed at the next start),
    e.g. 'SIGUSR1', which SLURM sends ahead of the time limit (``sbatch --signal``). SIGTERM always
    does. One of 'SIGUSR1', 'SIGUSR2', 'SIGHUP'; empty: SIGTERM only."""
    preempt_grace_s: float = 120.0
    """Seconds from a preemption signal to the last step being committed: the launcher gives torchrun
    this much (plus a margin) before it kills the workers; emitted cluster files ask the scheduler
    for more (SLURM's signal lead time, Kubernetes' terminationGracePeriodSeconds)."""
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
        check_choice("run.preempt_signal", self.preempt_signal, ("", "SIGUSR1", "SIGUSR2", "SIGHUP"))
        check_number("run.preempt_grace_s", self.preempt_grace_s, 1.0, 86400.0)
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
    defaults a rank held from outside is named within 15 steps (two full windows after the one the
    hold starts in)."""
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
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    """Replica groups under a torchft quorum (``resilient.recovery``); off by default."""
    recovery: RamTierConfig = field(default_factory=RamTierConfig)
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
            location = parse_url(self.checkpoint.url)
        except ConfigError as e:
            raise ConfigError(f"checkpoint.url: {e}") from e
        if location.scheme == "memory":  # a run would exit 0 with no step durable anywhere
            raise ConfigError(
                f"checkpoint.url={self.checkpoint.url}: memory:// keeps a checkpoint in one process's memory, "
                "which every rank has its own of and none outlives the run: set a path or s3://BUCKET/PREFIX"
            )

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
        for section, (name, _, hidden) in _COMPONENTS.items():
            inner = {k: v for k, v in out[section].pop(name).items() if k not in hidden}
            out[section] = {**inner, **out[section]}
        return out


_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "parallel": ParallelConfig,
    "model": ModelConfig,
    "data": DataSection,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "replica": ReplicaConfig,
    "recovery": RamTierConfig,
    "metrics": MetricsConfig,
}
_COMPONENTS: dict[str, tuple[str, type, tuple[str, ...]]] = {
    "data": ("pipeline", DataConfig, ()),
    "checkpoint": ("storage", CheckpointerConfig, STORAGE_SET_BY_TRAINER),
}
"""Sections that hold a component's own config in a field: (that field, the component's config
class, its fields that are no recipe keys). The component's fields are keys of the section itself
(``data.seed``, ``checkpoint.io_threads``): one config per component, declared once."""


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _component_keys(section: str) -> list[str]:
    if section not in _COMPONENTS:
        return []
    _, cls, hidden = _COMPONENTS[section]
    return [name for name in _fields(cls) if name not in hidden]


def allowed_keys(section: str) -> list[str]:
    """The keys a recipe may set in ``section``."""
    nested = _COMPONENTS[section][0] if section in _COMPONENTS else None
    return _component_keys(section) + [name for name in _fields(_SECTIONS[section]) if name != nested]


def _coerce(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """Check keys against the dataclass and normalize numbers, so '1' and '1.0' mean the same float
    (the data fingerprint hashes the values: 1 and 1.0 would be different streams)."""
    allowed = allowed_keys(section)
    out = {}
    fields = _fields(_SECTIONS[section])
    if section in _COMPONENTS:
        fields.update(_fields(_COMPONENTS[section][1]))
    defaults = {name: f.default for name, f in fields.items()}
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


def _build(section: str, cls: type, values: dict[str, Any]) -> Any:
    try:
        return cls(**values)
    except ConfigError as e:
        message = str(e)
        named = re.match(r"\w+", message)
        if named and named.group() in _fields(cls) and cls is not _SECTIONS[section]:
            message = f"{section}.{message}"  # a component's own check names its field alone
        raise ConfigError(f"[{section}] {message}") from e
    except TypeError as e:  # a wrong type that the section's own checks did not catch
        raise ConfigError(f"[{section}] {e}; allowed keys: {sorted(allowed_keys(section))}") from e


def _build_section(section: str, values: dict[str, Any], data: DataConfig | None = None) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table of keys, got {values!r}")
    values = _coerce(section, values)
    if section == "model" and data is not None:
        values = {**{k: derive(data) for k, derive in _FROM_DATA.items()}, **values}
    if section not in _COMPONENTS:
        return _build(section, _SECTIONS[section], values)
    name, cls, _ = _COMPONENTS[section]
    inner = {k: values.pop(k) for k in _component_keys(section) if k in values}
    outer = _build(section, _SECTIONS[section], values)
    defaults = outer.storage_defaults() if section == "checkpoint" else {}
    setattr(outer, name, _build(section, cls, {**defaults, **inner}))
    return outer


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
