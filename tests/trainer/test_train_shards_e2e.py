"""Training on real media end to end: a corpus of real containers, ``resilient-data build``, then
``resilient-train`` on the shards on 2 ranks, resumed on 1 and back on 2 mid-epoch.

Checked: every step's sample ids are those the stream defines for it (so none repeated or skipped
across the world-size changes), a window whose media were damaged after the build is skipped at
train time on the rank that holds it, counted in ``metrics.jsonl`` and named in ``skipped.jsonl``
at every step that holds it, and the model's vocabulary is the build's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.runfiles import read_jsonl, read_jsonl_by_step
from resilient.tools.demo_media import SETTINGS  # the media demo's recipe changes: one list
from resilient.trainer.config import load_config
from resilient.trainer.data import OmniPipeline, RowKey
from tests.procs import communicate_or_fail

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _build(corpus: Path, dest: Path) -> None:
    command = [sys.executable, "-m", "resilient.tools.data", "build", str(corpus), "--out", str(dest)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _damage_first_member(dest: Path, ext: str) -> str:
    """Zero the first 256 bytes of the first ``ext`` member in the shards (its container header):
    the build's index still lists it, its media no longer decode. Returns its key."""
    manifest = json.loads((dest / "manifest.json").read_text())
    for shard in manifest["shards"]:
        index = json.loads((dest / shard["index"]).read_text())
        for sample in index["samples"]:
            if ext in sample["members"] and sample.get("audio") == ext:
                offset, _ = sample["members"][ext]
                with open(dest / shard["tar"], "r+b") as f:
                    f.seek(offset)
                    f.write(b"\0" * 256)
                return sample["key"]
    raise AssertionError(f"no {ext} member in {dest}")


def _train(run_dir: Path, shards: Path, nproc: int, steps: int) -> None:
    command = [sys.executable, "-m", "resilient.tools.train", "--nproc", str(nproc), "--config", TINY]
    command += _sets(f'run.dir="{run_dir}"', f'data.shards="{shards}"', f"run.steps={steps}", *SETTINGS)
    command += _sets(f"parallel.dp_shard={nproc}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_or_fail(proc, 240, str(command))
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"


@pytest.mark.timeout(600)
def test_train_on_real_media_resumes_on_other_world_sizes_exactly_once(tmp_path: Path) -> None:
    from resilient.tools.media_corpus import write_corpus

    corpus, shards, run_dir = tmp_path / "corpus", tmp_path / "shards", tmp_path / "run"
    write_corpus(str(corpus), clips=8, seed=1)
    _build(corpus, shards)
    damaged = _damage_first_member(shards, "flac")

    _train(run_dir, shards, 2, 3)  # 2 ranks, then 1, then 2 again: both directions mid-epoch
    _train(run_dir, shards, 1, 5)
    _train(run_dir, shards, 2, 9)

    config = load_config(TINY, [f"run.dir={run_dir}", f"data.shards={shards}", *SETTINGS])
    build = json.loads((shards / "manifest.json").read_text())
    assert config.model.vocab_size == config.data.pipeline.vocab_size == build["tokenizer"]["vocab_size"]
    pipeline = OmniPipeline(config.data.pipeline)
    expected, cursor = {}, RowKey(0, 0)
    for step in range(1, 10):
        expected[step] = sorted(pipeline.sample_ids_for_step(cursor))
        cursor = pipeline._stream.advance(cursor, config.data.pipeline.global_rows)
    logged = {
        step: sorted(r["sample_ids"])
        for step, r in read_jsonl_by_step(str(run_dir / "group0" / "samples.jsonl")).items()
    }
    assert logged == expected
    items = pipeline._stream.source.num_items
    assert any(sid.startswith("1:") for ids in logged.values() for sid in ids), "the run should cross an epoch"
    epoch0 = [sid for ids in logged.values() for sid in ids if sid.startswith("0:")]
    assert len(epoch0) == len(set(epoch0)) == items

    # The damaged clip's windows: skipped at every step that held them, never a crash.
    holding = {step for step, ids in expected.items() if any(sid.split(":")[1].split("#")[0] == damaged for sid in ids)}
    skipped = read_jsonl(str(run_dir / "group0" / "skipped.jsonl"))
    assert holding and {s["step"] for s in skipped} == holding, (holding, skipped)
    assert all(s["sample_id"].split(":")[1].split("#")[0] == damaged and s["reason"] for s in skipped)
    metrics = read_jsonl_by_step(str(run_dir / "group0" / "metrics.jsonl"))
    assert {step for step, m in metrics.items() if m["data_skipped"]} == holding
    pipeline.close()
