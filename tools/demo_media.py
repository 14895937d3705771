"""``make demo``'s real-media phase: a corpus of real containers, built into WebDataset shards,
trained on 2 ranks, resumed on 1, with the exactly-once check and what was skipped.

1. ``resilient.tools.media_corpus`` writes mp4 (H.264 + AAC, MPEG-4 video only), FLAC and WAV
   clips with captions, timed and untimed, and one corrupt file, from the synthetic source;
2. ``resilient-data build`` probes every file, skips the corrupt one (``skipped.jsonl``), trains a
   byte-level BPE on the captions and writes the shards;
3. the tiny recipe trains on them (``data.source = "shards"``) on 2 ranks, then resumes on 1 rank
   mid-epoch; every window of every clip is seen exactly once per epoch across the resume.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter

from resilient.runfiles import SAMPLES_FILE, SKIPPED_FILE, group_file, read_jsonl, read_jsonl_by_step
from resilient.trainer.data.shards.format import SKIPPED as BUILD_SKIPPED_FILE
from resilient.trainer.launching.torchrun import run, torchrun_command

FIRST_STEPS, MORE_STEPS = 4, 5
SETTINGS = [
    'data.source="shards"',
    "data.row_len=128",
    "data.global_rows=2",
    "data.max_clip_seconds=2.0",
    "data.num_workers=1",
    "data.log_samples=true",
    "parallel.tp=1",
    "checkpoint.persist_every=2",
    "run.log_every=1",
]


def _train(recipe: str, run_dir: str, shards: str, nproc: int, steps: int) -> None:
    overrides = [f"run.dir={run_dir}", f"data.shards={shards}", f"run.steps={steps}", *SETTINGS]
    overrides.append(f"parallel.dp_shard={nproc}")
    args = argparse.Namespace(nproc=nproc, config=recipe, overrides=overrides)
    code = run(torchrun_command(args), grace_s=30.0)
    if code != 0:
        sys.exit(f"[demo] training on real media with {nproc} rank(s) failed with exit code {code}")


def _build(corpus: str, shards: str) -> None:
    command = [sys.executable, "-m", "resilient.tools.data", "build", corpus, "--out", shards, "--shard-size", "256KiB"]
    done = subprocess.run(command, text=True, capture_output=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"[demo] resilient-data build failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "[demo] build done", flush=True)


def _items(shards: str, recipe: str, run_dir: str) -> int:
    from resilient.trainer.config import load_config
    from resilient.trainer.data.stream import RowStream

    config = load_config(recipe, [f"run.dir={run_dir}", f"data.shards={shards}", *SETTINGS])
    return RowStream(config.data.pipeline).source.num_items


def _check(run_dir: str, items: int) -> str:
    samples = {step: r["sample_ids"] for step, r in read_jsonl_by_step(group_file(run_dir, SAMPLES_FILE, 0)).items()}
    seen = Counter(sid for ids in samples.values() for sid in ids)
    repeated = [sid for sid, n in seen.items() if n > 1]
    epochs = sorted({int(sid.split(":")[0]) for sid in seen})
    incomplete = [e for e in epochs[:-1] if sum(sid.startswith(f"{e}:") for sid in seen) != items]
    if repeated or incomplete or sorted(samples) != list(range(1, FIRST_STEPS + MORE_STEPS + 1)):
        sys.exit(f"[check] FAILED: repeated {repeated[:5]}, incomplete epochs {incomplete}, steps {sorted(samples)}")
    return (
        f"[check] {len(seen)} windows over {len(samples)} steps (2 ranks, then 1), none repeated; "
        f"epochs {epochs[:-1]} complete ({items} windows each), epoch {epochs[-1]} in progress"
    )


def run_media_phase(recipe: str, out_dir: str) -> None:
    from resilient.tools.media_corpus import write_corpus

    corpus, shards, run_dir = (os.path.join(out_dir, name) for name in ("corpus", "shards", "run"))
    files = write_corpus(corpus, clips=12, seed=0)
    print(f"[demo] wrote {len(files)} media files under {corpus}", flush=True)
    _build(corpus, shards)
    print(f"[demo] train {FIRST_STEPS} steps on 2 ranks, then resume on 1 rank for {MORE_STEPS} more", flush=True)
    _train(recipe, run_dir, shards, 2, FIRST_STEPS)
    _train(recipe, run_dir, shards, 1, FIRST_STEPS + MORE_STEPS)
    print("\n=== real media: build, train, resume on another world size ===")
    print(_check(run_dir, _items(shards, recipe, run_dir)))
    for line in read_jsonl(os.path.join(shards, BUILD_SKIPPED_FILE)):
        print(f"[skipped at build] {json.dumps(line)}")
    train_skips = read_jsonl(group_file(run_dir, SKIPPED_FILE, 0))
    print(f"[skipped in training] {len(train_skips)} window(s)" + "".join(f"\n  {json.dumps(s)}" for s in train_skips))
    print(f"[files] shards {shards}, samples {group_file(run_dir, SAMPLES_FILE, 0)}")
