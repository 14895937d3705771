"""``resilient-chaos run`` end to end: the smoke scenario passes, and a scenario whose invariant is
broken on purpose fails and names it (the harness itself must be able to fail).

Both run the same job (2 groups x 1 rank of the tiny recipe), so the second reuses the first's
fault-free twin from the shared cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
INVARIANTS = {
    "finished",
    "commits_verify",
    "exactly_once",
    "replicas_identical",
    "twin_match",
    "steps_lost_within_bound",
    "no_orphans",
    "storage_faults_absorbed",
    "slowed_rank_named",
    "final_step_durable",
    "ram_restores_on_branch",
}
GOODPUT = {"total_s", "productive_s", "detect_s", "reconfigure_s", "reload_s", "replay_s"}


def _chaos(scenario: str, report: Path, cache: str, timeout_s: float = 200) -> tuple[int, dict, str]:
    command = [
        sys.executable,
        "-m",
        "resilient.tools.chaos",
        "run",
        scenario,
        "--report",
        str(report),
        "--cache",
        cache,
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    assert (report / "report.json").exists(), out[-3000:]
    return proc.returncode, json.loads((report / "report.json").read_text()), out


@pytest.mark.timeout(240)
def test_smoke_scenario_passes_and_reports(tmp_path: Path, twin_cache: str) -> None:
    code, report, out = _chaos("smoke", tmp_path / "smoke", twin_cache)
    assert code == 0, out[-3000:]
    assert report["passed"] is True
    assert set(report["invariants"]) == INVARIANTS
    assert all(v["ok"] for v in report["invariants"].values()), report["invariants"]
    (fault,) = report["faults"]
    assert fault["kind"] == "kill_rank" and fault["state"] == "done"
    assert 5 <= fault["at_step"] <= 6, fault
    assert fault["killed"][0]["group"] == 1 and fault["killed"][0]["rank"] == 0
    assert fault["restore_source"] == "peer", "the killed group healed from the live one"
    assert fault["steps_lost"] <= 1
    assert 0 < fault["detected_s"] <= fault["recovered_s"] < 60, fault
    assert set(report["goodput"]) >= GOODPUT
    good = report["goodput"]
    parts = sum(
        good[k]
        for k in ("productive_s", "detect_s", "reconfigure_s", "reload_s", "replay_s", "startup_s", "shutdown_s")
    )
    assert good["productive_s"] > 0 and good["detect_s"] > 0
    assert parts == pytest.approx(good["total_s"], abs=0.1), good
    assert report["run"]["restarts"] == [[1, 1]], "only group 1 restarted, once"
    assert report["twin"]["steps_with_other_participants"], "group 0 trained alone for a while"
    assert report["twin"]["max_abs_diff"] is None or report["twin"]["max_abs_diff"] <= 1e-5
    png = tmp_path / "smoke" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # resilient-report reads the same run: the restart, the heal and goodput causes summing to its total.
    from resilient.tools.report import write_report

    summary = write_report(str(tmp_path / "smoke" / "run"), str(tmp_path / "report"))
    causes = summary["goodput"]["causes"]
    assert sum(c["seconds"] for c in causes.values()) == pytest.approx(summary["goodput"]["total_s"], rel=0.02)
    assert summary["incarnations"]["count"] >= 2 and (tmp_path / "report" / "report.html").stat().st_size > 20_000


@pytest.mark.timeout(240)
def test_broken_invariant_makes_the_harness_fail_and_name_it(tmp_path: Path, twin_cache: str) -> None:
    code, report, out = _chaos("broken_replica", tmp_path / "broken", twin_cache)
    assert code == 1, out[-3000:]
    assert report["passed"] is False
    verdicts = report["invariants"]
    assert verdicts["replicas_identical"]["ok"] is False
    assert "groups hold different parameters after step" in verdicts["replicas_identical"]["reason"]
    assert verdicts["twin_match"]["ok"] is False, "group 1's corrupted gradients reached the checkpoint"
    for name in ("finished", "commits_verify", "exactly_once", "no_orphans", "final_step_durable"):
        assert verdicts[name]["ok"], (name, verdicts[name])
    assert "FAILED: replicas_identical, twin_match" in out
    assert [f["kind"] for f in report["faults"]] == ["kill_rank", "corrupt_replica"]
