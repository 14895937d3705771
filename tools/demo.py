"""``make demo``: train the omni model, stop, resume it on a different mesh, then lose a replica
group's rank mid-run and heal it live, on CPU.

1. ``configs/demo.toml`` on 4 gloo ranks (dp_shard=2 x tp=2) for 60 steps, checkpoints every 20
   under ``runs/demo/ckpt``;
2. the same run resumed on 2 ranks (dp_shard=2, tp=1) for 20 more steps: the checkpoint is
   resharded on load and the data stream continues where it stopped;
3. a summary: losses, checkpoints, throughput, where the files are, and a check that every sample
   was consumed at most once (exactly once per finished epoch) across the resume;
4. a fresh replicated run under ``runs/demo/replicas``: 2 replica groups x 2 ranks (torchft
   lighthouse + quorum, ``resilient-train --replica-groups 2``). At step ``KILL_STEP`` the demo
   SIGKILLs group 1's rank 1 by its pid file; group 0 keeps committing alone; torchrun restarts
   group 1, which heals from group 0 over the network and trains on. The summary shows the kill,
   the heal time (``events.jsonl``) and the two groups' final parameter digests; the demo exits
   non-zero if they differ. (Group 0 waits at step ``HOLD_STEP`` for group 1 to be back, at most
   ``HOLD_S`` seconds, so that a slow restart on a busy machine still shows a heal.)
5. the RAM tier (``resilient.tools.demo_ram``): a node lost mid-run, its rank restored from its
   buddy's RAM and the other from its own, with no storage read;
6. real media (``resilient.tools.demo_media``): a corpus of real containers built into WebDataset
   shards, trained on 2 ranks and resumed on 1, exactly once, with what was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from typing import Any

from resilient import Checkpointer
from resilient.runfiles import (
    CONFIG_FILE,
    FINAL_DIGEST,
    METRICS_FILE,
    SAMPLES_FILE,
    events_path,
    group_file,
    logs_dir,
    read_events,
    read_jsonl_by_step,
    read_pid,
)
from resilient.tools.demo_media import run_media_phase
from resilient.tools.demo_ram import run_ram_phase
from resilient.trainer.config import load_config
from resilient.trainer.launching.launch import ReplicaJob, ReplicaLaunch
from resilient.trainer.launching.torchrun import run, torchrun_command

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "demo.toml")
RUN_DIR = os.path.abspath(os.environ.get("RESILIENT_DEMO_DIR", "runs/demo"))
FIRST_STEPS, MORE_STEPS = 60, 20
REPLICA_DIR = os.path.join(RUN_DIR, "replicas")
RAM_DIR = os.path.join(RUN_DIR, "ram")
MEDIA_DIR = os.path.join(RUN_DIR, "media")
TINY_RECIPE = os.path.join(os.path.dirname(RECIPE), "tiny.toml")
REPLICA_STEPS, KILL_STEP, HOLD_STEP, HOLD_S = 40, 10, 32, 90.0


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
    metrics = read_jsonl_by_step(group_file(RUN_DIR, METRICS_FILE, 0))
    samples = {s: r["sample_ids"] for s, r in read_jsonl_by_step(group_file(RUN_DIR, SAMPLES_FILE, 0)).items()}
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
        f"(keep_last={config.checkpoint.storage.keep_last})"
    )
    print(f"[files] metrics: {group_file(RUN_DIR, METRICS_FILE, 0)}")
    print(f"        samples: {group_file(RUN_DIR, SAMPLES_FILE, 0)}")
    print(f"        config:  {group_file(RUN_DIR, CONFIG_FILE, 0)}")
    print(_check_samples(samples, config.data.pipeline.num_samples))


def hold_for_rejoin(trainer: Any):
    """Step hook (``run.step_hooks``) of the replica phase: group 0 waits once, at HOLD_STEP, until
    the killed group is joining again."""
    held: list[int] = []

    def hook(step: int, trainer: Any) -> None:
        if trainer.group != 0 or held or step < HOLD_STEP:
            return
        held.append(step)
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline and not any(
            e["event"] == "joining" and e["attempt"] > 0 for e in read_events(trainer.config.run.dir)
        ):
            time.sleep(0.2)

    return hook


def _group_step(group: int) -> int:
    path = group_file(REPLICA_DIR, METRICS_FILE, group)
    metrics = read_jsonl_by_step(path) if os.path.exists(path) else {}
    return max(metrics) if metrics else 0


def _replicas() -> None:
    sets = [
        f"run.dir={REPLICA_DIR}",
        "parallel.tp=1",
        f"run.steps={REPLICA_STEPS}",
        "run.log_every=1000",
        "checkpoint.persist_every=20",
        'run.step_hooks=["resilient.tools.demo:hold_for_rejoin"]',
    ]
    launch = ReplicaLaunch(
        groups=2,
        nproc_per_group=2,
        run_dir=REPLICA_DIR,
        max_restarts=2,
        grace_s=40.0,
        trainer_args=["--config", RECIPE, *[a for s in sets for a in ("--set", s)]],
    )
    job = ReplicaJob(launch)
    try:
        job.start()
        while _group_step(1) < KILL_STEP:
            if any(p.poll() is not None for p in job.groups.values()):
                sys.exit(f"[demo] a replica group exited before step {KILL_STEP}; logs: {job.log_dir}")
            time.sleep(0.05)
        pid = read_pid(REPLICA_DIR, 1, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        job.events.write("demo_kill", group=1, rank=1, pid=pid, step=_group_step(1))
        print(f"[demo] SIGKILL group 1 rank 1 (pid {pid}) at its step {_group_step(1)}", flush=True)
        code = job.wait()
    finally:
        job.stop()
    if code != 0:
        sys.exit(f"[demo] the replicated run failed with exit code {code}; logs: {job.log_dir}")


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _replica_summary() -> None:
    events = read_events(REPLICA_DIR)
    kill = next(e for e in events if e["event"] == "demo_kill")
    steps = [e for e in events if e["event"] == "step"]
    g0_after = [e for e in steps if e["group"] == 0 and e["t"] > kill["t"]]
    solo = [e["step"] for e in g0_after if e["committed"] and e["participants"] == 1]
    rejoin = next(e for e in events if e["event"] == "joining" and e["group"] == 1 and e["attempt"] > 0)
    restart = next(e for e in events if e["event"] == "start" and e["group"] == 1 and e["attempt"] > 0)
    healed = next((e for e in steps if e["group"] == 1 and e["healed"] and e["t"] > rejoin["t"]), None)
    finals = [_read_json(group_file(REPLICA_DIR, FINAL_DIGEST, g)) for g in range(2)]
    print("\n=== replica groups: kill and live heal ===")
    print(f"[kill]  group 1 rank 1 (pid {kill['pid']}) SIGKILLed at step {kill['step']}")
    print(
        f"[solo]  group 0 committed alone: steps {solo[0]}..{solo[-1]} ({len(solo)} steps); next commit "
        f"{min(e['t'] for e in g0_after if e['committed']) - kill['t']:.2f} s after the kill; discarded attempts: "
        f"{[e['step'] for e in g0_after if not e['committed']]}"
    )
    if healed is None or restart["source"] != "peer":
        sys.exit(f"[check] FAILED: group 1 did not heal from a peer: {restart}")
    print(
        f"[heal]  group 1 restarted {rejoin['t'] - kill['t']:.1f} s after the kill, healed from group 0 at step "
        f"{restart['step']} ({healed['heal_bytes'] / 2**20:.2f} MiB/rank in {healed['heal_s']:.3f} s), first "
        f"participating commit (step {healed['step']}) {healed['t'] - rejoin['t']:.2f} s after rejoining"
    )
    held = [e["t"] for e in steps if e["group"] == 0 and e["committed"] and e["step"] in (HOLD_STEP, HOLD_STEP + 1)]
    if len(held) == 2 and solo and solo[-1] >= HOLD_STEP:
        print(
            f"        (group 0's step {HOLD_STEP} -> {HOLD_STEP + 1} took {held[1] - held[0]:.1f} s: it waits there, "
            f"at most {HOLD_S:.0f} s, until group 1 is back)"
        )
    digests = [f["params_sha256"] for f in finals]
    print(
        f"[final] group 0 step {finals[0]['step']} params {digests[0][:16]}...  "
        f"group 1 step {finals[1]['step']} params {digests[1][:16]}..."
    )
    if digests[0] != digests[1] or finals[0]["optim_sha256"] != finals[1]["optim_sha256"]:
        sys.exit("[check] FAILED: the replica groups ended with different parameters")
    samples: dict[int, list[str]] = {}
    for g in range(2):
        for step, record in read_jsonl_by_step(group_file(REPLICA_DIR, SAMPLES_FILE, g)).items():
            if samples.setdefault(step, record["sample_ids"]) != record["sample_ids"]:
                sys.exit(f"[check] FAILED: the groups disagree on the samples of step {step}")
    if sorted(samples) != list(range(1, REPLICA_STEPS + 1)):
        sys.exit(f"[check] FAILED: committed steps {sorted(samples)}")
    config = load_config(RECIPE, [f"run.dir={REPLICA_DIR}"])
    print("[check] both groups ended with identical parameters and optimizer state")
    print(_check_samples(samples, config.data.pipeline.num_samples))
    print(f"[files] {events_path(REPLICA_DIR)}, logs under {logs_dir(REPLICA_DIR)}")


def main() -> None:
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    print(f"[demo] 1/5: {FIRST_STEPS} steps on 4 ranks (dp_shard=2 x tp=2) -> {RUN_DIR}", flush=True)
    _train(4, f"run.steps={FIRST_STEPS}")
    print(f"[demo] 2/5: resume on 2 ranks (dp_shard=2 x tp=1) for {MORE_STEPS} more steps", flush=True)
    _train(2, "parallel.tp=1", f"run.steps={FIRST_STEPS + MORE_STEPS}")
    _summary()
    print(f"\n[demo] 3/5: 2 replica groups x 2 ranks, {REPLICA_STEPS} steps -> {REPLICA_DIR}", flush=True)
    _replicas()
    _replica_summary()
    print(f"\n[demo] 4/5: RAM tier, 2 ranks on 2 simulated nodes, snapshot every 2 steps -> {RAM_DIR}", flush=True)
    run_ram_phase(RECIPE, RAM_DIR)
    print(f"\n[demo] 5/5: real media: corpus -> WebDataset shards -> 2 ranks -> resume on 1 -> {MEDIA_DIR}", flush=True)
    run_media_phase(TINY_RECIPE, MEDIA_DIR)
    _report()


def _report() -> None:
    """Where the main run's time went: report.html and summary.json (``resilient-report``)."""
    from resilient.tools.report import write_report

    summary = write_report(RUN_DIR, RUN_DIR)
    goodput = summary.get("goodput", {})
    print(f"\n[report] {os.path.join(RUN_DIR, 'report.html')} (goodput {goodput.get('goodput', 0):.0%})")
    for line in summary.get("diagnoses", [])[:3]:
        print(f"[report] {line}")


if __name__ == "__main__":
    main()
