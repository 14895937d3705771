"""trainer/config.py: recipes, --set overrides and validation; the shipped recipes load."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.errors import ConfigError
from resilient.trainer.config import (
    TrainConfig,
    allowed_keys,
    config_from_dict,
    load_config,
    parse_override,
)
from resilient.trainer.data.state import fingerprint
from resilient.trainer.train import CONFIG_ERROR_EXIT, main

pytestmark = pytest.mark.timeout(60)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = str(CONFIGS / "tiny.toml")


@pytest.mark.parametrize("recipe", ["tiny.toml", "demo.toml"])
def test_shipped_recipes_load(recipe: str) -> None:
    config = load_config(str(CONFIGS / recipe))
    assert config.parallel.dp_shard * config.parallel.tp == 4
    assert config.checkpoint.url.endswith("/ckpt")


def test_keys_the_tools_rely_on_exist() -> None:
    keys = {f"{s}.{k}" for s in ("run", "parallel", "data", "checkpoint") for k in allowed_keys(s)}
    assert {
        "run.dir",
        "run.steps",
        "run.seed",
        "parallel.dp_shard",
        "parallel.tp",
        "data.seed",
        "data.global_rows",
        "data.row_len",
        "data.log_samples",
        "checkpoint.url",
        "checkpoint.persist_every",
        "checkpoint.keep_last",
    } <= keys


def test_overrides_are_toml_literals() -> None:
    config = load_config(
        TINY,
        [
            "parallel.tp=1",
            "data.log_samples=true",
            "optim.betas=[0.8, 0.9]",
            'run.dir="/tmp/a b"',
            "checkpoint.url=/tmp/ckpt",
            "run.peak_flops=1e12",
            "run.steps=7",
        ],
    )
    assert config.parallel.tp == 1
    assert config.data.log_samples is True
    assert config.optim.betas == [0.8, 0.9]
    assert config.run.dir == "/tmp/a b"
    assert config.checkpoint.url == "/tmp/ckpt"  # not a TOML literal: taken as a string
    assert config.run.peak_flops == 1e12 and config.run.steps == 7


def test_later_override_wins_and_url_defaults_under_run_dir() -> None:
    config = load_config(TINY, ["run.dir=/tmp/x", "run.dir=/tmp/y"])
    assert config.checkpoint.url == "/tmp/y/ckpt"


def test_model_input_sizes_follow_the_data() -> None:
    config = load_config(TINY, ["data.audio_bands=32", "data.patch_size=2", "data.vocab_size=100"])
    assert config.model.audio_dim == 32
    assert config.model.video_dim == 2 * 2 * 3
    assert config.model.vocab_size == 100
    assert config.model.max_positions == config.data.pipeline.max_positions


def test_int_for_float_does_not_change_the_data_fingerprint() -> None:
    # The fingerprint hashes values: 1 and 1.0 must not make a resumed run refuse its checkpoint.
    a = load_config(TINY, ["data.min_clip_seconds=1"])
    b = load_config(TINY, ["data.min_clip_seconds=1.0"])
    assert fingerprint(a.data.pipeline) == fingerprint(b.data.pipeline)


def test_to_dict_round_trips() -> None:
    config = load_config(TINY, ["data.log_samples=true", "parallel.tp=1"])
    again = config_from_dict(config.to_dict())
    assert again == config
    assert isinstance(again, TrainConfig)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.stepz=3", r"unknown key run.stepz; allowed keys in \[run\]: .*'steps'"),
        ("runn.steps=3", r"unknown section 'runn'; allowed: \['run', 'parallel'"),
        ("run.steps=-1", r"run.steps=-1 is out of range: allowed >= 0"),
        ("run.steps=2.5", r"run.steps=2.5 must be an integer"),
        ("run.steps=abc", r"run.steps='abc' must be an integer"),
        ("data.log_samples=1", r"data.log_samples=1 must be true or false"),
        ("data.row_len=8", r"\[data\] DataConfig.row_len=8 is out of range"),
        ("model.dim=0", r"\[model\] ModelConfig.dim=0 must be an integer >= 1"),
        ("parallel.tp=0", r"\[parallel\] ParallelConfig.tp=0"),
        ("parallel.tp=3", r"parallel.tp does not fit the model: ParallelConfig.tp=3 must divide"),
        ("parallel.dp_shard=3", r"parallel.dp_shard=3 must divide data.global_rows=8 .*\[1, 2, 4, 8\]"),
        ("parallel.pp=0", r"\[parallel\] ParallelConfig.pp=0 must be an integer >= 1"),
        ("parallel.pp=3", r"parallel.pp=3 with pp_schedule='1F1B' makes 3 pipeline stages but model.n_layers=2"),
        (
            "parallel.pp_schedule='gpipe'",
            r"ParallelConfig.pp_schedule='gpipe' must be one of \['1F1B', 'interleaved1F1B'\]",
        ),
        ("parallel.pp_microbatches=-1", r"ParallelConfig.pp_microbatches=-1 must be an integer >= 0"),
        ("parallel.sequence_parallel=1", r"parallel.sequence_parallel=1 must be true or false"),
        ("parallel.cp=2", r"ParallelConfig.cp=2: context parallelism is not supported: .* set parallel.cp=1"),
        ("model.audio_dim=80", r"model.audio_dim=80 must equal the data's audio_dim=16"),
        ("model.max_positions=8", r"model.max_positions=8 must be >= 69"),
        ("optim.betas=[0.9]", r"optim.betas=\[0.9\] must be a list of two numbers"),
        ("optim.lr=0", r"optim.lr=0.0 is out of range: allowed \(0.0, 10.0\]"),
        ("checkpoint.persist_every=0", r"checkpoint.persist_every=0 is out of range"),
        ("checkpoint.url=3", r"checkpoint.url=3 must be a string"),
        # Each rank's own memory, gone with the run: before, such a run exited 0 with nothing durable.
        ("checkpoint.url='memory://x'", r"checkpoint.url=memory://x: memory:// keeps .* set a path or s3://"),
        ("checkpoint.url='s3:/bucket/x'", r"checkpoint.url: 's3:/bucket/x' looks like a URL without '://'"),
        ("run.device='tpu'", r"run.device='tpu' must be one of"),
        ("steps=3", r"expected section.key=value"),
        ("run.steps", r"expected section.key=value"),
    ],
)
def test_bad_keys_and_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.pp=2", "parallel.pp_schedule='interleaved1F1B'"], r"makes 4 pipeline stages but model.n_layers=2"),
        (["parallel.pp=2", "parallel.pp_microbatches=3"], r"pp_microbatches=3 must divide the 4 rows .*\[2, 4\]"),
        (
            [
                "parallel.pp=2",
                "parallel.dp_shard=1",
                "data.global_rows=12",
                "model.n_layers=4",
                "parallel.pp_schedule='interleaved1F1B'",
                "parallel.pp_microbatches=3",
            ],
            r"pp_microbatches=3 must be a multiple of parallel.pp=2",
        ),
        (["parallel.pp=2", "parallel.pp_microbatches=1"], r"pp_microbatches=1 must be >= parallel.pp=2"),
        (
            ["replica.enabled=true", "replica.groups=2", "parallel.pp=2", "parallel.dp_shard=1"]
            + ["data.global_rows=12", "parallel.pp_microbatches=4"],
            r"must divide the 6 rows .* shared by 2 replica group\(s\)\): use one of \[2, 3, 6\]",
        ),
        (
            ["replica.enabled=true", "replica.groups=2", "parallel.pp=2", "data.global_rows=4"],
            r"pp_microbatches=4 must divide the 2 rows .*: raise data.global_rows to a multiple of 16",
        ),
        (["parallel.tp=1", "parallel.sequence_parallel=true"], r"sequence_parallel=true needs tp > 1"),
        (
            [
                "parallel.tp=4",
                "model.n_heads=4",
                "model.n_kv_heads=4",
                "data.row_len=130",
                "parallel.sequence_parallel=true",
            ],
            r"needs parallel.tp=4 to divide data.row_len=130",
        ),
    ],
)
def test_bad_pipeline_and_sequence_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_pipeline_settings_resolve() -> None:
    config = load_config(TINY, ["parallel.pp=2", "model.n_layers=4", "parallel.pp_schedule='interleaved1F1B'"])
    p = config.parallel
    assert (p.world_size, p.num_stages, p.stages_per_rank, p.microbatches) == (8, 4, 2, 4)
    assert p.describe() == "pp=2 x dp_shard=2 x tp=2"
    assert load_config(TINY).parallel.describe() == "dp_shard=2 x tp=2"


def test_bad_recipe_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 1\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[trainer]\nsteps = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config section\(s\) \['trainer'\]"):
        load_config(str(unknown))


def test_parse_override_values() -> None:
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a.b = true") == (["a", "b"], True)
    assert parse_override("a.b='x=y'") == (["a", "b"], "x=y")
    assert parse_override("a.b=s3://bucket/run") == (["a", "b"], "s3://bucket/run")


def test_world_size_mismatch_fails_before_any_collective(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["--config", TINY, "--set", "run.dir=/nonexistent"]) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "parallel.pp=1 x parallel.dp_shard=2 x parallel.tp=2 = 4 ranks, but 2 were started" in err
    assert main(["--config", TINY, "--set", "run.stepz=1"]) == CONFIG_ERROR_EXIT
    assert "unknown key run.stepz" in capsys.readouterr().err


def test_every_checkpointer_setting_is_a_checkpoint_key_with_one_meaning() -> None:
    import dataclasses

    from resilient.storage.config import CheckpointerConfig

    storage_fields = {f.name for f in dataclasses.fields(CheckpointerConfig)} - {"metrics_path"}
    assert storage_fields <= set(allowed_keys("checkpoint"))
    assert {"io_threads", "staging_bytes", "max_inflight", "commit_timeout_s", "keep_last"} <= storage_fields
    config = load_config(
        TINY,
        [
            "checkpoint.io_threads=3",
            "checkpoint.staging_bytes=33554432",
            "checkpoint.max_inflight=2",
            "checkpoint.commit_timeout_s=90",
            "checkpoint.keep_last=0",
            "checkpoint.writer='process'",
        ],
    )
    storage = config.checkpoint.storage
    assert (storage.io_threads, storage.staging_bytes, storage.max_inflight) == (3, 32 << 20, 2)
    assert storage.commit_timeout_s == 90.0 and storage.close_timeout_s == 1800.0  # the other from timeout_s
    assert storage.keep_last == 0 and storage.writer == "process"  # 0 keeps every step, as in the class
    defaults = load_config(None, ["checkpoint.timeout_s=120"]).checkpoint.storage
    assert (defaults.keep_last, defaults.commit_timeout_s, defaults.close_timeout_s) == (3, 120.0, 120.0)
    assert config_from_dict(config.to_dict()) == config
    assert "metrics_path" not in config.to_dict()["checkpoint"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("checkpoint.io_threads=0", r"\[checkpoint\] checkpoint\.io_threads=0 is out of range"),
        ("checkpoint.keep_last=-1", r"checkpoint\.keep_last=-1 is out of range: allowed >= 0"),
        ("checkpoint.writer_nice=20", r"checkpoint\.writer_nice must be an integer in \[0, 19\]"),
        ("checkpoint.metrics_path='x'", r"unknown key checkpoint\.metrics_path"),
    ],
)
def test_checkpointer_keys_are_checked_naming_the_recipe_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])


def test_the_trainer_builds_its_checkpointer_from_the_section(tmp_path: Path) -> None:
    from resilient.trainer.build import build_checkpointer

    config = load_config(TINY, [f"run.dir={tmp_path}", "checkpoint.io_threads=2", "checkpoint.keep_last=0"])
    ckpt = build_checkpointer(config, str(tmp_path / "saves.jsonl"))
    try:
        assert ckpt.config.io_threads == 2 and ckpt.config.keep_last == 0
        assert ckpt.config.metrics_path == str(tmp_path / "saves.jsonl")
        assert ckpt.config.commit_timeout_s == config.checkpoint.timeout_s
    finally:
        ckpt.close()


def test_section_classes_say_what_they_hold() -> None:
    import dataclasses

    from resilient.recovery.config import RamTierConfig, ReplicaConfig
    from resilient.trainer.state import TrainingParts

    config = load_config(None)
    assert type(config.replica) is ReplicaConfig and type(config.recovery) is RamTierConfig
    assert "data" in {f.name for f in dataclasses.fields(TrainingParts)}  # the data pipeline
    assert "pipeline" not in {f.name for f in dataclasses.fields(TrainingParts)}
    with pytest.raises(ImportError):
        __import__("resilient.trainer.pipeline")  # pipeline parallelism is trainer/pipeline_parallel.py
