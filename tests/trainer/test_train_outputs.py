"""trainer/observing/outputs.py: metrics/samples lines, last line per step wins, group directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient.errors import ConfigError
from resilient.runfiles import group_dir, read_jsonl_by_step
from resilient.trainer.observing.outputs import RunOutputs, StepStats, sort_sample_ids

pytestmark = pytest.mark.timeout(60)


def _stats(step: int, loss: float) -> StepStats:
    return StepStats(
        step=step,
        loss=loss,
        text_loss=loss,
        tokens=1024,
        loss_tokens=900,
        lr=1e-3,
        grad_norm=0.5,
        step_time_s=0.1,
        data_wait_s=0.0,
        ckpt_stall_s=0.0,
        data_skipped=0,
        tokens_per_s=10240.0,
        mfu=0.01,
        peak_flops=1e12,
    )


def test_appends_and_the_last_line_of_a_step_counts(tmp_path: Path, capsys) -> None:
    for losses in ([(1, 3.0), (2, 2.5)], [(2, 2.4), (3, 2.0)]):  # a restart redoes step 2
        out = RunOutputs(str(tmp_path), enabled=True, log_samples=True, log_every=2, steps=3)
        for step, loss in losses:
            out.step(_stats(step, loss))
            out.samples(step, [f"0:{step}"])
        out.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # torn by a kill
    metrics = read_jsonl_by_step(str(tmp_path / "metrics.jsonl"))
    assert [(s, r["loss"]) for s, r in metrics.items()] == [(1, 3.0), (2, 2.4), (3, 2.0)]
    assert set(metrics[1]) >= {
        "step",
        "loss",
        "tokens",
        "step_time_s",
        "data_wait_s",
        "ckpt_stall_s",
        "tokens_per_s",
        "mfu",
    }
    assert len(read_jsonl_by_step(str(tmp_path / "samples.jsonl"))) == 3
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in printed] == ["2/3", "2/3", "3/3"]


def test_disabled_outputs_write_nothing(tmp_path: Path) -> None:
    out = RunOutputs(str(tmp_path / "x"), enabled=False, log_samples=True, log_every=1, steps=1)
    out.step(_stats(1, 1.0))
    out.samples(1, ["0:1"])
    out.close()
    assert not (tmp_path / "x").exists()


def test_group_dir_and_sample_order(monkeypatch) -> None:
    monkeypatch.setenv("RESILIENT_GROUP", "3")
    assert group_dir("/r").endswith("/r/group3")
    monkeypatch.setenv("RESILIENT_GROUP", "x")
    with pytest.raises(ConfigError, match="RESILIENT_GROUP='x'"):
        group_dir("/r")
    assert sort_sample_ids({"1:2", "0:10", "0:9"}) == ["0:9", "0:10", "1:2"]
    assert json.dumps(_stats(1, 1.0).to_json())


def test_an_unwritable_output_file_never_stops_training(tmp_path: Path, caplog) -> None:
    # Only rank 0 writes these: an OSError raised here would leave the other ranks in a collective.
    (tmp_path / "metrics.jsonl").mkdir()  # opening it for append fails (IsADirectoryError)
    (tmp_path / "config.json").mkdir()
    out = RunOutputs(str(tmp_path), enabled=True, log_samples=True, log_every=100, steps=3)
    out.write_config({"run": {}}, {})
    for step in (1, 2, 3):
        out.step(_stats(step, 1.0))
        out.samples(step, [f"0:{step}"])
    warned = [r.getMessage() for r in caplog.records if "training goes on without it" in r.getMessage()]
    assert len(warned) == 2 and "metrics.jsonl" in warned[1] and "config.json" in warned[0], warned
    assert len(read_jsonl_by_step(str(tmp_path / "samples.jsonl"))) == 3  # the other file is unaffected
