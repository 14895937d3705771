"""SaveOutcomes: every background save's error is raised once, none is dropped."""

from __future__ import annotations

import pytest

from resilient import CommitError, StorageError
from resilient.storage.handle import SaveHandle
from resilient.storage.outcomes import SaveOutcomes

pytestmark = pytest.mark.timeout(10)


def _failed(step: int) -> SaveHandle:
    handle = SaveHandle(step)
    handle.attempt = f"attempt-{step}"
    handle.fail(StorageError(f"step {step} failed"))
    return handle


def _raised(outcomes: SaveOutcomes, late: BaseException | None = None) -> str | None:
    try:
        outcomes.agree(None, 0, late=late)
    except Exception as e:  # noqa: BLE001 - the test reads which error each call raised
        return str(e)
    return None


def test_every_failed_save_finished_by_one_call_is_raised_at_a_later_call():
    outcomes = SaveOutcomes()
    outcomes.track(_failed(10))
    outcomes.track(_failed(20))
    raised = [_raised(outcomes) for _ in range(3)]
    assert "step 10 failed" in raised[0]
    assert "step 20 failed" in raised[1]  # was dropped by the first call
    assert raised[2] is None


def test_a_late_wait_does_not_swallow_a_finished_saves_error():
    outcomes = SaveOutcomes()
    outcomes.track(_failed(10))
    first = _raised(outcomes, late=CommitError("save of step 30 not decided"))
    assert "step 30 not decided" in first
    assert "step 10 failed" in _raised(outcomes)  # was consumed and lost under the late error
    assert _raised(outcomes) is None
