"""``make demo``: train the omni model, stop, and resume it on a different mesh, on CPU.

1. ``configs/demo.toml`` on 4 gloo ranks (dp_shard=2 x tp=2) for 60 steps, checkpoints every 20
   under ``runs/demo/ckpt``;
2. the same run resumed on 2 ranks (dp_shard=2, tp=1) for 20 more steps: the checkpoint is
   resharded on load and the data stream continues where it stopped;
3. a summary: losses, checkpoints, throughput, where the files are, and a check that every sample
   was consumed at most once (exactly once per finished epoch) across the resume.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections import Counter

from resilient import Checkpointer
from resilient.tools.train import run, torchrun_command
from resilient.trainer.config import load_config
from resilient.trainer.outputs import read_jsonl_by_step

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "demo.toml")
RUN_DIR = os.path.abspath(os.environ.get("RESILIENT_DEMO_DIR", "runs/demo"))
FIRST_STEPS, MORE_STEPS = 60, 20


def _train(nproc: int, *overrides: str) -> None:
    args = argparse.Namespace(nproc=nproc, config=RECIPE, overrides=[f"run.dir={RUN_DIR}", *overrides])
    code = run(torchrun_command(args), grace_s=30.0)
    if code != 0:
        sys.exit(f"[demo] training on {nproc} ranks failed with exit code {code}")


def _throughput(metrics: dict[int, dict], steps: range) -> tuple[float, float]:
    """Median step time and tokens/s over ``steps``, leaving out the first (start-up) step."""
    records = sorted((metrics[s] for s in steps[1:] if s in metrics), key=lambda r: r["step_time_s"])
    median = records[len(records) // 2]
    return median["step_time_s"], median["tokens_per_s"]


def _check_samples(samples: dict[int, list[str]], num_samples: int) -> str:
    seen = Counter(sid for ids in samples.values() for sid in ids)
    repeated = [sid for sid, n in seen.items() if n > 1]
    epochs = sorted({int(sid.split(":")[0]) for sid in seen})
    incomplete = [e for e in epochs[:-1] if sum(sid.startswith(f"{e}:") for sid in seen) != num_samples]
    if repeated or incomplete:
        sys.exit(f"[check] FAILED: repeated samples {repeated[:5]}, incomplete epochs {incomplete}")
    return (
        f"[check] {len(seen)} samples over {len(samples)} steps, none repeated; "
        f"epochs {epochs[:-1]} complete ({num_samples} samples each), epoch {epochs[-1]} in progress"
    )


def _summary() -> None:
    config = load_config(RECIPE, [f"run.dir={RUN_DIR}"])
    group = os.path.join(RUN_DIR, "group0")
    metrics = read_jsonl_by_step(os.path.join(group, "metrics.jsonl"))
    samples = {s: r["sample_ids"] for s, r in read_jsonl_by_step(os.path.join(group, "samples.jsonl")).items()}
    last = FIRST_STEPS + MORE_STEPS
    four = _throughput(metrics, range(1, FIRST_STEPS + 1))
    two = _throughput(metrics, range(FIRST_STEPS + 1, last + 1))
    print("\n=== resilient demo ===")
    print(
        f"[loss]  step 1: {metrics[1]['loss']:.4f}  step {FIRST_STEPS}: {metrics[FIRST_STEPS]['loss']:.4f}  "
        f"step {last}: {metrics[last]['loss']:.4f}  (text cross-entropy {metrics[1]['text_loss']:.3f} -> "
        f"{metrics[last]['text_loss']:.3f})"
    )
    print(
        f"[speed] 4 ranks (2x2): {four[0] * 1e3:.0f} ms/step, {four[1]:.0f} tokens/s; "
        f"2 ranks (2x1): {two[0] * 1e3:.0f} ms/step, {two[1]:.0f} tokens/s (median step; "
        f"{metrics[last]['tokens']} tokens/step)"
    )
    print(
        f"[ckpt]  committed steps {Checkpointer(config.checkpoint.url).steps()} under {config.checkpoint.url} "
        f"(keep_last={config.checkpoint.keep_last})"
    )
    print(f"[files] metrics: {os.path.join(group, 'metrics.jsonl')}")
    print(f"        samples: {os.path.join(group, 'samples.jsonl')}")
    print(f"        config:  {os.path.join(group, 'config.json')}")
    print(_check_samples(samples, config.data.pipeline.num_samples))


def main() -> None:
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    print(f"[demo] 1/2: {FIRST_STEPS} steps on 4 ranks (dp_shard=2 x tp=2) -> {RUN_DIR}", flush=True)
    _train(4, f"run.steps={FIRST_STEPS}")
    print(f"[demo] 2/2: resume on 2 ranks (dp_shard=2 x tp=1) for {MORE_STEPS} more steps", flush=True)
    _train(2, "parallel.tp=1", f"run.steps={FIRST_STEPS + MORE_STEPS}")
    _summary()


if __name__ == "__main__":
    main()
