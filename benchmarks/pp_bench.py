"""Pipeline parallelism on 2 CPU ranks: step time against FSDP, the bubble, checkpoints across layouts.

    .venv/bin/python benchmarks/pp_bench.py            # ~5 min on 2 cores
    .venv/bin/python benchmarks/pp_bench.py --quick    # ~2-3 min: 4 steps, M in {2, 4}, one repeat

Three cases, every line a JSON object with "bench": "pp" and a "case" (logs go to stderr):

1. ``step_time``: the real trainer (torchrun, configs/demo.toml, 2 gloo ranks) at the same world
   size as ``pp=2, dp_shard=1`` and ``pp=1, dp_shard=2``; medians of metrics.jsonl's step_time_s and
   tokens_per_s after ``--warmup`` steps, the final step (it saves) excluded. 1F1B on the demo's
   2 layers, interleaved 1F1B (2 stages per rank) on 4 layers, each against pp=1 on the same model.
   ``--repeats`` alternate the order of the two layouts (a neighbour on the machine hits both).
2. ``bubble``: one torchrun world of 2 ranks builds the stages with ``build_parts`` and times
   ``Stages.step``. Busy time is the time inside the stages' ``forward_one_chunk`` /
   ``backward_one_chunk`` / ``backward_weight_one_chunk``: the schedule calls exactly these for a
   microbatch's compute and does its P2P sends, receives and waits outside them, so
   ``1 - busy / wall`` is the share of the step a rank spent not computing (waiting on its peer,
   the transfers, the schedule's bookkeeping). Hooks on the module would miss the backward of the
   first stage (no tensor input to hook) and torch.profiler adds its own cost per op; wrapping the
   schedule's own calls costs two perf_counter reads per microbatch. Against it the theory of equal
   stages and free communication: (pp-1)/(M+pp-1) for 1F1B, (pp-1)/(v*M+pp-1) interleaved with v
   stages per rank (Narayanan et al. 2021).
3. ``save`` / ``restore``: saves.jsonl's final save of the step-time runs and of resumed runs, and
   the ``restore`` events (events.jsonl, "seconds" per rank) of copies of a pp=2 and a pp=1 run
   resumed on each layout (pp2->pp1 and pp1->pp2 reshard; pp2->pp2 and pp1->pp1 for reference).

On a 2-core machine both ranks share the cores, and P2P runs over gloo/TCP on loopback: the
measured bubble includes the transfers and the other rank's use of the core, so it is not the
schedule's alone; read it next to the theory, and the step-time ratio as this machine's answer only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resilient.dist import free_port  # noqa: E402
from resilient.runfiles import (  # noqa: E402
    EVENTS_FILE,
    METRICS_FILE,
    SAVES_FILE,
    group_file,
    read_jsonl,
    read_jsonl_by_step,
)
from tests.procs import kill_tree  # noqa: E402  (the same tree kill the e2e tests use)

DEMO = str(ROOT / "configs" / "demo.toml")
LAYOUT_DEGREES = {"pp2": {"pp": 2, "dp_shard": 1}, "pp1": {"pp": 1, "dp_shard": 2}}
"""The two layouts of 2 ranks compared (tp=1 in both: the demo's tp=2 is overridden)."""
LAYOUTS = {name: tuple(f"parallel.{k}={v}" for k, v in d.items()) for name, d in LAYOUT_DEGREES.items()}
NO_SAVES = ("parallel.tp=1", "checkpoint.persist_every=1000000")  # persist_every >= 1: only the final step saves
SCHEDULES = {"1F1B": 2, "interleaved1F1B": 4}
"""Schedule -> model.n_layers of its runs (interleaved 1F1B on 2 ranks makes 4 stages)."""


def _emit(case: str, **fields: Any) -> None:
    print(json.dumps({"bench": "pp", "case": case, **fields}), flush=True)


def _log(message: str) -> None:
    print(f"[pp_bench] {message}", file=sys.stderr, flush=True)


def _median(values: Iterable[float]) -> float:
    return round(statistics.median(values), 6)


# -- processes ------------------------------------------------------------------------------------


def _torchrun(args: list[str], log_path: str, timeout_s: float) -> None:
    """Run ``torchrun --nproc-per-node 2 <args>`` on a free port; its output goes to ``log_path``;
    raise with the log's tail if it fails or runs past ``timeout_s`` (its whole tree is killed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            proc.wait(timeout=30)
            rc = None
    if rc != 0:
        tail = Path(log_path).read_text()[-3000:]
        what = f"timed out after {timeout_s:g} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"torchrun {' '.join(args[:8])} ... {what}; log {log_path}:\n{tail}")


def _train(run_dir: str, sets: Iterable[str], timeout_s: float) -> None:
    overrides = [f'run.dir="{run_dir}"', *NO_SAVES, *sets]
    args = ["-m", "resilient.trainer", "--config", DEMO, *(x for s in overrides for x in ("--set", s))]
    start = time.perf_counter()
    _torchrun(args, run_dir + ".log", timeout_s)
    _log(f"{os.path.basename(run_dir)}: {time.perf_counter() - start:.1f} s")


def _model_sets(schedule: str) -> tuple[str, ...]:
    return (f"model.n_layers={SCHEDULES[schedule]}", f'parallel.pp_schedule="{schedule}"')


# -- 1. step time ---------------------------------------------------------------------------------


def _steady_steps(run_dir: str, warmup: int) -> list[dict[str, Any]]:
    """metrics.jsonl's steps after the warm-up, without the last one (its save is in its time)."""
    records = read_jsonl_by_step(group_file(run_dir, METRICS_FILE, 0))
    last = max(records)
    steady = [r for step, r in records.items() if warmup < step < last]
    if not steady:
        raise RuntimeError(f"{run_dir}: no steps after a warm-up of {warmup} (of {last}): raise --steps")
    return steady


def step_time_case(work: str, args: argparse.Namespace) -> dict[str, str]:
    """Step time and tokens/s of pp=2 against pp=1 for each schedule; returns the 1F1B runs' dirs
    of the first repeat by layout (the checkpoint case resumes them)."""
    first_runs: dict[str, str] = {}
    for schedule in SCHEDULES:
        steps: dict[str, list[list[dict[str, Any]]]] = {"pp2": [], "pp1": []}
        for repeat in range(args.repeats):
            order = ["pp2", "pp1"] if repeat % 2 == 0 else ["pp1", "pp2"]
            for layout in order:
                run_dir = os.path.join(work, f"{schedule}-{layout}-r{repeat}")
                sets = [*LAYOUTS[layout], *_model_sets(schedule), f"run.steps={args.steps}"]
                _train(run_dir, sets, args.timeout_s)
                steps[layout].append(_steady_steps(run_dir, args.warmup))
                if schedule == "1F1B" and repeat == 0:
                    first_runs[layout] = run_dir
        medians = {}
        for layout, runs in steps.items():
            pooled = [r for run in runs for r in run]
            medians[layout] = (_median(r["step_time_s"] for r in pooled), _median(r["tokens_per_s"] for r in pooled))
            _emit(
                "step_time",
                layout=layout,
                schedule=schedule if layout == "pp2" else None,
                compared_schedule=schedule,
                n_layers=SCHEDULES[schedule],
                world=2,
                **LAYOUT_DEGREES[layout],
                microbatches=4 if layout == "pp2" else 1,
                step_time_s=medians[layout][0],
                tokens_per_s=medians[layout][1],
                step_time_s_each=[_median(r["step_time_s"] for r in run) for run in runs],
                steps_measured=len(pooled),
                warmup=args.warmup,
                repeats=args.repeats,
            )
        _emit(
            "step_time_ratio",
            schedule=schedule,
            n_layers=SCHEDULES[schedule],
            name="pp2_over_pp1",
            step_time=round(medians["pp2"][0] / medians["pp1"][0], 4),
            tokens_per_s=round(medians["pp2"][1] / medians["pp1"][1], 4),
        )
    return first_runs


# -- 2. bubble ------------------------------------------------------------------------------------


def _instrument(stages: list[Any]) -> dict[int, dict[str, float]]:
    """Wrap each pipeline stage's compute calls with a clock; seconds by stage index and kind."""
    busy: dict[int, dict[str, float]] = {}
    for stage in stages:
        totals = busy.setdefault(stage.stage_index, {"forward_s": 0.0, "backward_s": 0.0})
        for name, kind in (
            ("forward_one_chunk", "forward_s"),
            ("backward_one_chunk", "backward_s"),
            ("backward_weight_one_chunk", "backward_s"),
        ):
            setattr(stage, name, _timed(getattr(stage, name), totals, kind))
    return busy


def _timed(call: Callable[..., Any], totals: dict[str, float], kind: str) -> Callable[..., Any]:
    def timed(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*a, **kw)
        finally:
            totals[kind] += time.perf_counter() - start

    return timed


def _bubble_one(schedule_name: str, microbatches: int, steps: int, warmup: int) -> dict[str, Any]:
    """This rank's busy and wall seconds of ``steps`` timed ``Stages.step`` calls (after ``warmup``)."""
    import torch
    import torch.distributed as dist

    from resilient.trainer.build import build_parts
    from resilient.trainer.config import load_config
    from resilient.trainer.model import BATCH_KEYS, count_loss_tokens

    sets = [*LAYOUTS["pp2"], *NO_SAVES, *_model_sets(schedule_name), f"parallel.pp_microbatches={microbatches}"]
    config = load_config(DEMO, [*sets, "data.num_workers=0"])
    torch.manual_seed(0)
    _, parts = build_parts(config, torch.device("cpu"))
    assert parts.stages is not None
    try:
        batch = parts.data.next_batch()  # one batch, reused: the data path is not measured
        inputs = {key: batch[key] for key in BATCH_KEYS}
        tokens = count_loss_tokens(inputs)
        rows = inputs["text_tokens"].shape[0] // parts.stages.microbatches
        busy = _instrument(parts.stages.pipeline_stages(rows))  # the stages Stages.step will run
        walls = []
        for step in range(warmup + steps):
            if step == warmup:
                for totals in busy.values():
                    totals.update(forward_s=0.0, backward_s=0.0)
            dist.barrier()  # both ranks start the step together: the wall is the schedule's alone
            start = time.perf_counter()
            parts.stages.step(inputs, tokens)
            walls.append(time.perf_counter() - start)
            parts.optimizer.zero_grad(set_to_none=True)
    finally:
        parts.data.close()
    return {"wall_s": sum(walls[warmup:]), "wall_step_s": walls[warmup:], "stages": busy}


def bubble_worker(out_dir: str, cases: list[tuple[str, int]], steps: int, warmup: int, timeout_s: float) -> None:
    """One rank of the bubble world (run under torchrun): every case, results to rank<r>.json."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    results = [{"schedule": s, "microbatches": m, **_bubble_one(s, m, steps, warmup)} for s, m in cases]
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def bubble_theory(pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Idle share of a step under equal stage times and free communication (Narayanan et al. 2021)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def bubble_case(work: str, args: argparse.Namespace) -> None:
    cases = [(s, m) for s in SCHEDULES for m in args.microbatches]
    spec = json.dumps({"cases": cases, "steps": args.bubble_steps, "warmup": args.bubble_warmup})
    start = time.perf_counter()
    _torchrun(
        [str(Path(__file__).resolve()), "--bubble-worker", work, spec, "--timeout-s", str(args.timeout_s)],
        os.path.join(work, "bubble.log"),
        args.timeout_s,
    )
    _log(f"bubble world: {time.perf_counter() - start:.1f} s")
    ranks = [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(2)]
    for per_rank in zip(*ranks, strict=True):
        schedule, microbatches = per_rank[0]["schedule"], per_rank[0]["microbatches"]
        per_stage = SCHEDULES[schedule] // 2
        busy = [sum(t["forward_s"] + t["backward_s"] for t in r["stages"].values()) for r in per_rank]
        measured = [round(1 - b / r["wall_s"], 4) for b, r in zip(busy, per_rank, strict=True)]
        _emit(
            "bubble",
            schedule=schedule,
            pp=2,
            stages_per_rank=per_stage,
            microbatches=microbatches,
            n_layers=SCHEDULES[schedule],
            bubble_theory=round(bubble_theory(2, microbatches, per_stage), 4),
            bubble_measured=round(statistics.mean(measured), 4),
            bubble_measured_by_rank=measured,
            busy_s_by_rank=[round(b / args.bubble_steps, 5) for b in busy],
            wall_step_s_by_rank=[_median(r["wall_step_s"]) for r in per_rank],
            busy_by_stage={
                k: {kind: round(v / args.bubble_steps, 5) for kind, v in t.items()}
                for k, t in sorted(
                    ((k, t) for r in per_rank for k, t in r["stages"].items()), key=lambda kt: int(kt[0])
                )
            },
            steps=args.bubble_steps,
            warmup=args.bubble_warmup,
        )


# -- 3. checkpoints -------------------------------------------------------------------------------


def _saves(run_dir: str) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(group_file(run_dir, SAVES_FILE, 0)) if r.get("outcome") == "committed"]


def _resume(source: str, target: str, layout: str, steps: int, timeout_s: float) -> list[dict[str, Any]]:
    """Copy ``source``'s run dir to ``target`` and resume it on ``layout`` for 2 more steps; the
    ``restore`` events the resumed ranks wrote (checked: both from the persistent checkpoint)."""
    shutil.copytree(source, target)
    events = os.path.join(target, EVENTS_FILE)
    before = len(read_jsonl(events))
    _train(target, [*LAYOUTS[layout], *_model_sets("1F1B"), f"run.steps={steps + 2}"], timeout_s)
    restores = [e for e in read_jsonl(events)[before:] if e.get("event") == "restore"]
    if sorted(e["rank"] for e in restores) != [0, 1] or any(
        e["source"] != "persistent" or e["step"] != steps for e in restores
    ):
        raise RuntimeError(f"{target}: expected both ranks to restore step {steps} from the checkpoint: {restores}")
    return restores


def checkpoint_case(work: str, runs: dict[str, str], args: argparse.Namespace) -> None:
    saves: dict[str, list[dict[str, Any]]] = {layout: _saves(run_dir) for layout, run_dir in runs.items()}
    for source in ("pp2", "pp1"):
        for target in ("pp1", "pp2"):
            dest = os.path.join(work, f"resume-{source}-to-{target}")
            restores = _resume(runs[source], dest, target, args.steps, args.timeout_s)
            saves[target] += _saves(dest)[-1:]
            seconds = [round(e["seconds"], 5) for e in sorted(restores, key=lambda e: e["rank"])]
            _emit(
                "restore",
                from_layout=source,
                to_layout=target,
                resharded=source != target,
                seconds=max(seconds),
                seconds_by_rank=seconds,
                bytes_by_rank=[e["bytes"] for e in sorted(restores, key=lambda e: e["rank"])],
                step=args.steps,
                n_layers=SCHEDULES["1F1B"],
            )
    medians = {}
    for layout, records in saves.items():
        medians[layout] = _median(r["total_s"] for r in records)
        _emit(
            "save",
            layout=layout,
            **LAYOUT_DEGREES[layout],
            n_layers=SCHEDULES["1F1B"],
            total_s=medians[layout],
            snapshot_s=_median(r["snapshot_s"] for r in records),
            persist_s=_median(r["persist_s"] for r in records),
            commit_s=_median(r["commit_s"] for r in records),
            total_s_each=[round(r["total_s"], 5) for r in records],
            bytes_total=records[0]["bytes_total"],
            bytes_written_rank0=records[0]["bytes_written"],
            samples=len(records),
        )
    _emit("save_ratio", name="pp2_over_pp1", total_s=round(medians["pp2"] / medians["pp1"], 4))


# -- main -----------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps, M in {2, 4}, one repeat (the smoke test)")
    parser.add_argument("--steps", type=int, default=25, help="trainer steps per step-time run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=2, help="step-time runs per layout, order alternated")
    parser.add_argument("--microbatches", type=lambda s: [int(m) for m in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--bubble-steps", type=int, default=10, help="timed Stages.step calls per case")
    parser.add_argument("--bubble-warmup", type=int, default=3)
    parser.add_argument("--dir", default=None, help="parent of the scratch dir pp_bench-XXXX (removed at the end)")
    parser.add_argument("--timeout-s", type=float, default=240, help="limit of each torchrun (and its collectives)")
    parser.add_argument("--bubble-worker", nargs=2, metavar=("DIR", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 4, 1, 1
        args.microbatches, args.bubble_steps, args.bubble_warmup = [2, 4], 2, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.bubble_worker:
        out_dir, spec = args.bubble_worker[0], json.loads(args.bubble_worker[1])
        cases = [(s, int(m)) for s, m in spec["cases"]]
        bubble_worker(out_dir, cases, spec["steps"], spec["warmup"], args.timeout_s)
        return
    work = tempfile.mkdtemp(prefix="pp_bench-", dir=args.dir)
    try:
        runs = step_time_case(work, args)
        bubble_case(work, args)
        checkpoint_case(work, runs, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
