"""The report's cadence section: intervals over the run, failures marked, expected waste."""

from __future__ import annotations

import pytest

from resilient.tools.report_cadence import cadence_figure, cadence_html, cadence_summary
from resilient.tools.report_data import RunData

pytestmark = pytest.mark.timeout(60)


def _run() -> RunData:
    events = [
        {"event": "startup", "group": 0, "t": 110.0, "total_s": 10.0, "cause": "first"},
        {"event": "cadence", "t": 150.0, "step": 10, "tier": "memory", "every_steps": 8, "previous": 20,
         "waste": 0.05, "waste_fixed": 0.07},
        {"event": "startup", "group": 0, "t": 300.0, "total_s": 20.0, "cause": "rank_failed"},
        {"event": "cadence", "t": 320.0, "step": 30, "tier": "memory", "every_steps": 4, "previous": 8,
         "waste": 0.04, "waste_fixed": 0.09},
        {"event": "cadence", "t": 330.0, "step": 40, "tier": "persist", "every_steps": 60, "previous": 100,
         "waste": 0.03, "waste_fixed": 0.09},
    ]  # fmt: skip
    return RunData(run_dir="/nowhere", events=events, groups={}, holds=[])


def test_summary_names_each_tiers_path_the_failures_and_the_waste_against_fixed():
    summary = cadence_summary(_run())
    assert summary is not None
    assert summary["memory"]["start_every"] == 20 and summary["memory"]["final_every"] == 4
    assert [p[2] for p in summary["memory"]["points"]] == [8, 4]
    assert summary["persist"]["final_every"] == 60
    assert summary["failures"] == [{"t": 280.0, "cause": "rank_failed", "group": 0}]
    assert (summary["expected_waste"], summary["expected_waste_fixed"]) == (0.03, 0.09)
    assert cadence_figure(_run(), summary, 100.0)[:8] == b"\x89PNG\r\n\x1a\n"
    html = cadence_html(_run(), summary, 100.0)
    assert "3.00%" in html and "9.00%" in html and "1 failure(s)" in html


def test_no_cadence_events_no_section():
    run = RunData(run_dir="/nowhere", events=[{"event": "startup", "t": 1.0}], groups={}, holds=[])
    assert cadence_summary(run) is None and cadence_html(run, None, 0.0) == ""
