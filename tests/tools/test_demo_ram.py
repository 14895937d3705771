"""The demo's RAM-tier summary names each rank's source as the restart's ``restore`` events do."""

from __future__ import annotations

import pytest

from resilient.runfiles import METRICS_FILE, append_jsonl, events_path, group_file
from resilient.tools.demo_ram import _summary

LOST_AT = 1000.0


def _restore(t: float, rank: int, step: int, source: str, reads: int = 0) -> dict:
    return {
        "t": t,
        "event": "restore",
        "group": 0,
        "rank": rank,
        "step": step,
        "source": source,
        "bytes": 3 << 19,
        "seconds": 0.25,
        "storage_reads": reads,
        "excluded": [],
    }


def _run_dir(tmp_path, restores: list[dict]) -> str:
    run_dir = str(tmp_path / "ram")
    for record in restores:
        append_jsonl(events_path(run_dir), record)
    for step in (8, 30):
        append_jsonl(group_file(run_dir, METRICS_FILE, 0), {"step": step, "loss": 1.0})
    return run_dir


@pytest.mark.timeout(30)
def test_each_rank_is_named_with_its_restart_source(tmp_path, capsys):
    """Issue 13 item 13: the summary printed every non-fresh restore of the run directory, so a
    restore recorded before the node was lost (an earlier start that resumed from storage) was
    shown, and checked, as if it were the restart's."""
    run_dir = _run_dir(
        tmp_path,
        [
            _restore(LOST_AT - 50, 0, 4, "persistent", reads=12),  # the first start, before the loss
            _restore(LOST_AT - 50, 1, 4, "persistent", reads=12),
            _restore(LOST_AT + 9, 1, 8, "buddy"),  # the restart: rank 1's line lands first
            _restore(LOST_AT + 9.5, 0, 8, "own"),
        ],
    )
    _summary(run_dir, LOST_AT)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "[ram] restore after losing node 1 (each rank's own restore event, from events.jsonl):"
    assert lines[2] == "  rank 0: step 8 from own (its own node's RAM), 1.50 MiB in 0.250 s, storage reads: 0"
    assert (
        lines[3] == "  rank 1: step 8 from buddy (its buddy node's copy, in RAM), 1.50 MiB in 0.250 s, storage reads: 0"
    )
    assert lines[4].startswith("[ram] resumed at step 8 ")


@pytest.mark.timeout(30)
def test_a_restart_that_read_storage_fails_the_demo(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, [_restore(LOST_AT + 9, 0, 8, "own"), _restore(LOST_AT + 9, 1, 4, "persistent", 12)])
    with pytest.raises(SystemExit) as failed:
        _summary(run_dir, LOST_AT)
    assert str(failed.value) == (
        "[demo] expected rank 0 from its own store and rank 1 from its buddy, no storage reads: "
        "{0: 'own', 1: 'persistent'}"
    )
    assert "  rank 1: step 4 from persistent (persistent storage)" in capsys.readouterr().out
