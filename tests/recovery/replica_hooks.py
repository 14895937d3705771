"""Step hooks for the replica-group end-to-end tests, loaded through ``run.step_hooks``.

``pace``: every rank sleeps ``RESILIENT_TEST_STEP_SLEEP`` seconds after each committed step, so a
test's SIGKILL lands mid-run; in group 0, once its step reaches ``RESILIENT_TEST_HOLD_STEP``, it also
waits (at most ``RESILIENT_TEST_HOLD_S``) until the killed group is joining again, so that the
run does not end before the restarted group can heal (a restart costs seconds of imports here).
Holding is safe: the lighthouse does not let the restarted group form a quorum alone while group 0
still heartbeats (a quorum needs more than half of the healthy groups).
"""

from __future__ import annotations

import os
import time

from resilient.recovery.events import read_events


def pace(trainer):
    sleep_s = float(os.environ.get("RESILIENT_TEST_STEP_SLEEP", "0"))
    hold_step = int(os.environ.get("RESILIENT_TEST_HOLD_STEP", "-1"))
    hold_s = float(os.environ.get("RESILIENT_TEST_HOLD_S", "90"))
    held = []

    def restarted(run_dir: str) -> bool:
        return any(e["event"] == "joining" and e["attempt"] > 0 for e in read_events(run_dir))

    def hook(step, trainer):
        time.sleep(sleep_s)
        if trainer.group == 0 and hold_step >= 0 and step >= hold_step and not held:
            held.append(step)
            deadline = time.monotonic() + hold_s
            while time.monotonic() < deadline and not restarted(trainer.config.run.dir):
                time.sleep(0.2)

    return hook
