"""trainer/observing/quiet.py: how a failed rank exits: 2 for bad input, 1 for a full disk (a failure of
the machine: rerunning once space is freed resumes)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from resilient.errors import CommitError, ConfigError, disk_full, from_payload, to_payload
from resilient.trainer.observing.quiet import ERROR_EXIT, RUNTIME_EXIT, final_claim_since, report_failure


@pytest.mark.timeout(10)
def test_a_full_disk_exits_1_and_bad_input_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = CommitError("[rank 0] step 2 not committed: rank(s) [1] failed: OSError(28, 'No space left on device')")
    assert report_failure(str(tmp_path), 0, full) == RUNTIME_EXIT == 1
    assert capsys.readouterr().err.startswith("error: [rank 0] step 2 not committed")
    assert report_failure(str(tmp_path / "b"), 0, ConfigError("checkpoint.url: bad")) == ERROR_EXIT == 2


@pytest.mark.timeout(10)
def test_a_full_disk_is_final_so_torchrun_does_not_restart_into_it(tmp_path: Path) -> None:
    full = CommitError("[rank 0] step 2 not committed: rank(s) [1] failed: OSError(28, 'No space left on device')")
    assert report_failure(str(tmp_path), 0, full) == RUNTIME_EXIT
    line = final_claim_since(str(tmp_path), 0.0)
    assert line is not None and line.startswith("error: [rank 0] step 2 not committed")
    # Any other runtime error may go away with a restart: not final.
    assert report_failure(str(tmp_path / "b"), 0, CommitError("[rank 0] peer lost")) == ERROR_EXIT
    assert final_claim_since(str(tmp_path / "b"), 0.0) is None


@pytest.mark.timeout(10)
def test_disk_full_is_known_by_errno_by_cause_and_across_ranks() -> None:
    raw = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full(raw) and disk_full(OSError(errno.EDQUOT, "quota"))
    wrapped = CommitError("saving step 3 failed")
    wrapped.__cause__ = raw
    assert disk_full(wrapped)
    assert disk_full(from_payload(to_payload(wrapped)))  # its text crossed, not its errno
    assert not disk_full(OSError(errno.EACCES, "Permission denied")) and not disk_full(None)
