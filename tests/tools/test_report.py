"""``resilient-report`` on run directories written by hand: a new-style run (issue-16 fields, two
incarnations, a slow rank, a hang) whose numbers are worked out below, an old-style run, the CLI."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from resilient.chaos.accounting import CAUSES
from resilient.tools.report import main

RUN_ID = "00112233aabbccdd"
T0 = 1000.0


def _jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _row(t: float, step: int, incarnation: int, step_time_s: float, ckpt_stall_s: float = 0.2) -> dict:
    return {
        "t": T0 + t, "run_id": RUN_ID, "incarnation": incarnation, "step": step, "loss": 3.0 - 0.1 * step,
        "tokens": 1024, "step_time_s": step_time_s, "data_wait_s": 0.1, "ckpt_stall_s": ckpt_stall_s,
        "tokens_per_s": 1024 / step_time_s, "mfu": 0.01 * step, "peak_flops": 1e12,
        "layout": {"world": 4, "dp_shard": 4, "tp": 1, "groups": 1},
    }  # fmt: skip


def _ranks(step: int, t: float) -> dict:
    """Four ranks; rank 3 computes 1.8x slower than its peers."""
    ranks = [
        {"rank": r, "step_s": 1.0, "data_wait_s": 0.1, "compute_s": 0.18 if r == 3 else 0.1, "grad_sync_s": 0.05,
         "optimizer_s": 0.02, "ckpt_stall_s": 0.2, "snapshot_s": 0.0}
        for r in range(4)
    ]  # fmt: skip
    return {"t": T0 + t, "run_id": RUN_ID, "incarnation": 0, "step": step, "steps": 2, "ranks": ranks}


def _event(t: float, event: str, **fields) -> dict:
    return {"t": T0 + t, "event": event, "group": 0, "run_id": RUN_ID, **fields}


def new_style_run(root: Path, straggler_event: bool = True) -> Path:
    """Incarnation 0 starts at T0, commits steps 1-4 at +10..+13 and dies; incarnation 1 starts at
    +18, restores step 2 in 3 s, commits steps 3-6 at +30..+33; ``done`` at +34.

    Goodput (34 s): startup 10 + (12 - 3 restore) = 19; restore 3; down 5 (+13..+18); replay 1
    (step 4 again); steps 2, 3, 4, 5, 6 carve 0.2/0.2/0.5/0.2/0.2 ckpt stall and 0.1 data wait each
    out of their 1 s; productive 3.2; shutdown 1."""
    run = root / "run"
    g = run / "group0"
    _jsonl(g / "metrics.jsonl", [
        _row(10, 1, 0, 2.0), _row(11, 2, 0, 1.0), _row(12, 3, 0, 1.0), _row(13, 4, 0, 1.0, ckpt_stall_s=0.5),
        _row(30, 3, 1, 3.0), _row(31, 4, 1, 1.5), _row(32, 5, 1, 1.0), _row(33, 6, 1, 1.0),
    ])  # fmt: skip
    _jsonl(g / "ranks.jsonl", [_ranks(4, 13), _ranks(6, 33)])
    save = {"event": "save", "rank": 0}
    _jsonl(g / "saves.jsonl", [
        {**save, "t": T0 + 12.5, "step": 2, "total_s": 1.0, "snapshot_s": 0.1, "outcome": "committed"},
        {**save, "t": T0 + 14.0, "step": 4, "total_s": 0.8, "snapshot_s": 0.3, "outcome": "failed"},
    ])  # fmt: skip
    phases = {"imports_s": 4.0, "process_group_s": 1.0, "model_s": 2.0, "first_step_s": 2.0}
    events = [
        _event(9, "restore", rank=0, step=0, source="fresh", seconds=0.05, incarnation=0),
        _event(9.1, "start", step=0, source="fresh", attempt=0, incarnation=0),
        _event(10, "startup", total_s=10.0, incarnation=0, phases={**phases, "restore_s": 0.0}),
        _event(15, "hang", rank=2, step=4, idle_s=120.0, path="group0/hang/rank2-0.txt", incarnation=0),
        _event(27, "restore", rank=1, step=2, source="persistent", seconds=2.5, incarnation=1),
        _event(27, "restore", rank=0, step=2, source="persistent", seconds=3.0, incarnation=1),
        _event(29, "start", step=2, source="persistent", attempt=1, incarnation=1),
        _event(30, "startup", total_s=12.0, incarnation=1, phases={**phases, "restore_s": 3.0}),
        _event(34, "done", step=6),
    ]
    if straggler_event:
        events.insert(3, _event(13.2, "straggler", rank=3, ratio=1.8, phase="compute_s", step=4, incarnation=0))
    _jsonl(run / "events.jsonl", events)
    (run / "run_id").write_text(RUN_ID + "\n")
    return run


def _report(run: Path, out: Path | None = None) -> dict:
    argv = [str(run)] + (["--out", str(out)] if out else [])
    assert main(argv) == 0
    return json.loads(((out or run) / "summary.json").read_text())


@pytest.mark.timeout(60)
def test_summary_of_a_new_style_run_has_the_worked_out_numbers(tmp_path: Path) -> None:
    summary = _report(new_style_run(tmp_path))
    assert summary["run_id"] == RUN_ID and summary["timing"] == "recorded" and summary["steps"] == 6
    good = summary["goodput"]
    assert good["total_s"] == pytest.approx(34.0)
    expected = {
        "productive_s": 3.2, "startup_s": 19.0, "restore_s": 3.0, "replay_s": 1.0, "ckpt_stall_s": 1.3,
        "data_wait_s": 0.5, "quorum_s": 0.0, "down_s": 5.0, "shutdown_s": 1.0,
    }  # fmt: skip
    assert set(good["causes"]) == set(CAUSES)
    for cause, seconds in expected.items():
        assert good["causes"][cause]["seconds"] == pytest.approx(seconds, abs=1e-6), cause
        assert good["causes"][cause]["fraction"] == pytest.approx(seconds / 34.0, abs=1e-6), cause
    assert sum(c["seconds"] for c in good["causes"].values()) == pytest.approx(good["total_s"])
    assert good["goodput"] == pytest.approx(3.2 / 34.0, abs=1e-6)
    # Step times 2, 1, 1, 1, 3, 1.5, 1, 1: sorted, p90 sits 0.3 of the way from 2 to 3.
    assert summary["step_time"] == pytest.approx({"p50": 1.0, "p90": 2.3, "p99": 2.93, "mean": 1.4375, "count": 8})
    incs = summary["incarnations"]
    assert incs["count"] == 2
    assert [(i["start_t"], i["end_t"], i["steps"]) for i in incs["list"]] == [
        (T0, T0 + 13, 4),
        (T0 + 18, T0 + 33, 4),
    ]
    assert incs["list"][1]["first_step"] == 3 and incs["list"][1]["restore_s"] == 3.0
    assert summary["stragglers"] == [
        {"group": 0, "rank": 3, "phase": "compute_s", "ratio": 1.8, "step": 4, "t": T0 + 13.2, "source": "event",
         "cleared_step": None, "duration_steps": None, "duration_s": None}
    ]  # fmt: skip
    assert summary["hangs"] == [
        {"t": T0 + 15, "group": 0, "rank": 2, "step": 4, "idle_s": 120.0, "path": "group0/hang/rank2-0.txt"}
    ]
    assert summary["saves"]["count"] == 2 and summary["saves"]["failed"] == 1
    assert [r["source"] for r in summary["restores"]] == ["fresh", "persistent"]


@pytest.mark.timeout(60)
def test_diagnoses_name_the_slow_phases_and_what_to_change(tmp_path: Path) -> None:
    summary = _report(new_style_run(tmp_path))
    diagnoses = summary["diagnoses"]
    # ckpt stall 1.9 s of 11.5 s of step time; data wait 0.8 s of it; startup 19 of 34 s.
    stall = 'checkpoint stall is 17% of step time: raise checkpoint.persist_every or use checkpoint.writer="process"'
    assert stall in diagnoses
    assert any(d.startswith("data wait is 7% of step time: raise data.num_workers") for d in diagnoses)
    assert any(d.startswith("startup is 56% of the run") and "imports_s 8.0 s" in d for d in diagnoses)
    assert any(d.startswith("downtime between incarnations is 15% of the run") for d in diagnoses)
    assert any(d.startswith("restore is 9% of the run") and "checkpoint.memory_every" in d for d in diagnoses)
    assert "rank 3 is a straggler in compute_s (1.8x the median) from step 4" in diagnoses
    assert any(d.startswith("rank 2 of group 0 hung at step 4") and "rank2-0.txt" in d for d in diagnoses)
    assert not any(d.startswith(("replayed", "shutdown")) for d in diagnoses), "under 5% of the run"
    phases = [p["phase"] for p in summary["phases"]]
    assert phases[:3] == ["startup_s", "down_s", "restore_s"], "slowest first"


@pytest.mark.timeout(60)
def test_only_the_trainers_straggler_events_name_stragglers(tmp_path: Path) -> None:
    # ranks.jsonl shows rank 3 slower, but the trainer's detector (consecutive windows, a share of
    # the step) did not flag it: the report does not second-guess it with a looser rule.
    summary = _report(new_style_run(tmp_path, straggler_event=False))
    assert summary["stragglers"] == []


@pytest.mark.timeout(60)
def test_report_html_is_one_self_contained_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _report(new_style_run(tmp_path), out)
    assert sorted(os.listdir(out)) == ["report.html", "summary.json"]
    page = (out / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4, "goodput, curves, per-rank breakdown, timeline"
    assert all(len(i) > 5000 for i in images)
    assert not re.search(r"""(?:src|href)\s*=\s*(?!["']data:)""", page), "no external asset"
    assert "<link" not in page and "<script" not in page
    assert "rank 3 is a straggler in compute_s" in page


def old_style_run(root: Path, with_events: bool = True) -> Path:
    """Before issue 16: no t/run_id/incarnation on rows, no ranks.jsonl, saves without t; steps
    1-4, then a restart from step 2 commits 3-6."""
    run = root / "old"
    g = run / "group0"
    steps = [1, 2, 3, 4, 3, 4, 5, 6]
    _jsonl(g / "metrics.jsonl", [
        {"step": s, "loss": 2.0, "step_time_s": 0.5, "data_wait_s": 0.05, "ckpt_stall_s": 0.0, "tokens_per_s": 100.0,
         "mfu": 0.01}
        for s in steps
    ])  # fmt: skip
    _jsonl(g / "saves.jsonl", [{"event": "save", "step": 2, "rank": 0, "total_s": 0.3, "outcome": "committed"}])
    if with_events:
        _jsonl(run / "events.jsonl", [
            {"t": 100.0, "event": "restore", "group": 0, "rank": 0, "step": 0, "source": "fresh", "seconds": 0.0},
            {"t": 200.0, "event": "restore", "group": 0, "rank": 0, "step": 2, "source": "persistent", "seconds": 1.5},
        ])  # fmt: skip
        pid = run / "pids" / "group0-rank0"
        pid.parent.mkdir()
        pid.write_text("4242\n")
        os.utime(pid, (150.0, 150.0))
    return run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_events", [True, False])
def test_an_old_style_run_still_reports(tmp_path: Path, with_events: bool) -> None:
    run = old_style_run(tmp_path, with_events)
    summary = _report(run)
    assert summary["timing"] == "synthesized" and summary["run_id"] is None
    incs = summary["incarnations"]["list"]
    assert [(i["first_step"], i["last_step"], i["steps"]) for i in incs] == [(1, 4, 4), (3, 6, 4)]
    good = summary["goodput"]
    assert sum(c["seconds"] for c in good["causes"].values()) == pytest.approx(good["total_s"])
    assert good["causes"]["replay_s"]["seconds"] == pytest.approx(0.5), "step 4 again"
    if with_events:  # times from the restore events: 100 + 4 x 0.5, then 200 + 4 x 0.5; rank 0's
        # pid file (rewritten at each process start) says the last incarnation started at 150.
        assert (incs[0]["end_t"], incs[1]["start_t"]) == (102.0, 150.0)
        assert good["causes"]["down_s"]["seconds"] == pytest.approx(48.0)
        assert good["causes"]["startup_s"]["seconds"] == pytest.approx(0.5 + 50.5 - 1.5)
        assert good["causes"]["restore_s"]["seconds"] == pytest.approx(1.5)
    assert summary["stragglers"] == [] and summary["hangs"] == []
    page = (run / "report.html").read_text()
    assert len(re.findall("data:image/png;base64,", page)) == 3 and "no ranks.jsonl" in page


@pytest.mark.timeout(30)
def test_cli_missing_run_dir_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run directory" in err and "Traceback" not in err
    assert main([str(tmp_path), "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --bogus" in err
    assert main([str(tmp_path)]) == 2, "a directory with no metrics is not a run"
    assert "no group<G>/metrics.jsonl" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_an_old_replica_group_run_takes_its_times_from_the_commit_events(tmp_path: Path) -> None:
    """Rows without ``t``: each gets its ``step`` event's time; the quorum wait is carved out."""
    run = tmp_path / "replicated"
    _jsonl(run / "group0" / "metrics.jsonl", [{"step": s, "loss": 1.0, "step_time_s": 0.5} for s in (1, 2, 3)])
    step = {"event": "step", "group": 0, "committed": True, "quorum_s": 0.3}
    commits = [{**step, "t": 9.0 + s, "step": s} for s in (1, 2, 3)]
    _jsonl(run / "events.jsonl", [
        {"t": 5.0, "event": "group_started", "group": 0, "pid": 1},
        {"t": 8.0, "event": "joining", "group": 0, "attempt": 0},
        *commits,
    ])  # fmt: skip
    summary = _report(run)
    assert summary["timing"] == "recorded"
    causes = {c: v["seconds"] for c, v in summary["goodput"]["causes"].items()}
    # Launched at 5 (group_started), first commit at 10, then two 1 s steps with 0.3 s of quorum each.
    assert summary["goodput"]["total_s"] == pytest.approx(7.0)
    assert causes["startup_s"] == pytest.approx(5.0)
    assert causes["quorum_s"] == pytest.approx(0.6)
    assert causes["productive_s"] == pytest.approx(1.4)


@pytest.mark.timeout(60)
def test_straggler_episodes_are_paired_listed_with_evidence_and_plotted(tmp_path: Path) -> None:
    run = new_style_run(tmp_path, straggler_event=False)
    windows = []
    for step, held in ((2, 0.0), (4, 0.4), (6, 0.0)):
        window = _ranks(step, 10 + step)
        for entry in window["ranks"]:
            entry.update(stalled_s=held if entry["rank"] == 1 else 0.0, late_s=0.01 * entry["rank"])
        windows.append(window)
    _jsonl(run / "group0" / "ranks.jsonl", windows)
    evidence = {"value_s": 0.4, "median_s": 0.0, "share": 0.4, "stalled_s": 0.4, "median_stalled_s": 0.0,
                "late_s": 0.01, "median_late_s": 0.02, "step_s": 1.0}  # fmt: skip
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    events += [
        _event(13.1, "straggler", rank=1, ratio=400.0, phase="stalled_s", step=4, **evidence),
        _event(33.1, "straggler_cleared", rank=1, phase="stalled_s", step=6, duration_steps=4, duration_s=20.0),
        _event(33.2, "straggler", rank=2, ratio=2.0, phase="data_wait_s", step=6, value_s=0.2, median_s=0.1,
               share=0.1, step_s=1.0),
        _event(33.3, "straggler", rank=None, scope="group", ratio=300.0, phase="stalled_s", step=6, value_s=0.3,
               median_s=0.0, share=0.3, step_s=1.0),
    ]  # fmt: skip
    _jsonl(run / "events.jsonl", events)
    out = tmp_path / "out"
    summary = _report(run, out)
    held, loader, group = summary["stragglers"]
    assert (held["rank"], held["phase"], held["step"], held["cleared_step"], held["duration_steps"]) == (
        1,
        "stalled_s",
        4,
        6,
        4,
    )
    assert held["stalled_s"] == 0.4 and held["median_late_s"] == 0.02 and held["duration_s"] == 20.0
    assert (loader["rank"], loader["cleared_step"]) == (2, None)  # open to the end of the run
    said = "rank 1 is a straggler held from outside 40% of the step (stalled 400 ms a step against its peers' 0 ms)"
    assert f"{said} from step 4 to step 6" in summary["diagnoses"]
    assert any(
        d.startswith("rank 2 is a straggler in data_wait_s (2.0x the median: 200 ms") and d.endswith("to the end")
        for d in summary["diagnoses"]
    )
    assert group["rank"] is None and group["cleared_step"] is None
    assert any(d.startswith("group 0 as a whole is a straggler held from outside 30%") for d in summary["diagnoses"])
    page = (out / "report.html").read_text()
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 5, "the lateness plot joins the four"
    assert 'alt="per-rank stalled time and lateness"' in page and "<td>stalled_s</td>" in page


@pytest.mark.timeout(60)
def test_cli_unwritable_out_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = old_style_run(tmp_path, True)
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"
    assert main([str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"resilient-report: error: cannot write the report into {out} (Not a directory)")
    assert err.rstrip().endswith("pass --out DIR, a writable one")
