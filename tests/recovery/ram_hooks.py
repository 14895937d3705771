"""Step hook for the RAM-tier end-to-end tests: every rank sleeps ``RESILIENT_TEST_STEP_SLEEP``
seconds after each committed step, so a SIGKILL from the test lands mid-run."""

from __future__ import annotations

import os
import time


def pace(trainer):
    sleep_s = float(os.environ.get("RESILIENT_TEST_STEP_SLEEP", "0"))

    def hook(step, trainer):
        time.sleep(sleep_s)

    return hook
