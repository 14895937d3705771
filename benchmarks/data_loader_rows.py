"""The loader rows of ``data_bench.py``: rows per second the shard loader delivers with 0, 1 and 2
DataLoader workers, against the rows per second the trainer consumes at the media demo's settings
(tiny recipe, ``tools/demo_media.py``), from a real corpus built into shards in a temp dir.

The issue's target: the loader delivers >= 3x what the trainer consumes (it is never what the step
waits for). The consumption is measured by a real one-rank training run on the same shards.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from resilient.tools.demo_media import SETTINGS as DEMO_SETTINGS

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.toml")
# The media demo's settings (tools/demo_media.py), on one rank: what the bench relates to.
SETTINGS = [*DEMO_SETTINGS, "parallel.dp_shard=1"]
LOADER_TARGET = 3.0


def build_shards(directory: str, clips: int) -> str:
    from resilient.tools.media_corpus import write_corpus

    corpus, shards = os.path.join(directory, "corpus"), os.path.join(directory, "shards")
    write_corpus(corpus, clips=clips, seed=0)
    command = [sys.executable, "-m", "resilient.tools.data", "build", corpus, "--out", shards]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return shards


def loader_rows_per_s(shards: str, workers: int, steps: int) -> float:
    """Rows per second of whole global batches, ``workers`` processes decoding ahead; the first
    batch (worker start, epoch plan) is not timed."""
    from resilient.trainer.config import load_config
    from resilient.trainer.data import OmniPipeline

    sets = [*SETTINGS, f"data.shards={shards}", f"data.num_workers={workers}", "run.dir=/tmp/unused"]
    config = load_config(TINY, sets).data.pipeline
    with OmniPipeline(config) as pipeline:
        pipeline.next_batch()
        pipeline.commit_step()
        start = time.perf_counter()
        for _ in range(steps):
            pipeline.next_batch()
            pipeline.commit_step()
        return steps * config.global_rows / (time.perf_counter() - start)


def trainer_rows_per_s(shards: str, run_dir: str, steps: int) -> float:
    """Rows per second a one-rank training run takes at these settings (median step less its data
    wait, the first step left out)."""
    from resilient.runfiles import read_jsonl

    command = [sys.executable, "-m", "resilient.tools.train", "--nproc", "1", "--config", TINY]
    for item in (f"data.shards={shards}", f"run.dir={run_dir}", f"run.steps={steps}", *SETTINGS):
        command += ["--set", item]
    subprocess.run(command, check=True, capture_output=True, timeout=600, cwd=REPO)
    # The step without its data wait: what the trainer would take if the loader were never late.
    records = read_jsonl(os.path.join(run_dir, "group0", "metrics.jsonl"))[1:]
    return 2 / statistics.median(m["step_time_s"] - m["data_wait_s"] for m in records)


def loader_lines(directory: str, quick: bool) -> list[dict]:
    steps = 30 if quick else 60  # fewer: worker start and thread spawn show up as loader time
    shards = build_shards(directory, clips=24 if quick else 60)
    consumed = trainer_rows_per_s(shards, os.path.join(directory, "run"), steps=12)
    lines = [{"bench": "data", "name": "trainer_consumption", "value": round(consumed, 1), "unit": "rows_per_s"}]
    for workers in (0, 1, 2):
        rate = loader_rows_per_s(shards, workers, steps)
        name = f"loader_{workers}_workers"
        lines.append({"bench": "data", "name": name, "value": round(rate, 1), "unit": "rows_per_s"})
        lines.append(
            {
                "bench": "ratio",
                "name": f"loader_{workers}_workers_over_consumption_vs_target_{LOADER_TARGET:g}",
                "value": round(rate / consumed / LOADER_TARGET, 3),
                "unit": "ratio",
            }
        )
    return lines
