"""Step hooks for the replica-group end-to-end tests, loaded through ``run.step_hooks``.

``pace``: every rank sleeps ``RESILIENT_TEST_STEP_SLEEP`` seconds after each committed step, so a
test's SIGKILL lands mid-run; in group 0, once its step reaches ``RESILIENT_TEST_HOLD_STEP``, it also
waits (at most ``RESILIENT_TEST_HOLD_S``) until the killed group is joining again, so that the
run does not end before the restarted group can heal (a restart costs seconds of imports here).
Holding is safe: the lighthouse does not let the restarted group form a quorum alone while group 0
still heartbeats (a quorum needs more than half of the healthy groups).
``RESILIENT_TEST_HOLD_STEP`` may list steps ("7,10"): the i-th hold waits for torchrun restart i
of the killed group (a group killed twice); after each hold, ``RESILIENT_TEST_HOLD_SETTLE_S`` more
seconds let the joiner's quorum request reach the lighthouse before group 0 asks again.
"""

from __future__ import annotations

import os
import time

from resilient.runfiles import read_events


def pace(trainer):
    sleep_s = float(os.environ.get("RESILIENT_TEST_STEP_SLEEP", "0"))
    hold_steps = [int(s) for s in os.environ.get("RESILIENT_TEST_HOLD_STEP", "").split(",") if s.strip()]
    hold_s = float(os.environ.get("RESILIENT_TEST_HOLD_S", "90"))
    settle_s = float(os.environ.get("RESILIENT_TEST_HOLD_SETTLE_S", "0"))
    held = []

    def restarted(run_dir: str, attempt: int) -> bool:
        return any(e["event"] == "joining" and e["attempt"] >= attempt for e in read_events(run_dir))

    def hook(step, trainer):
        time.sleep(sleep_s)
        if trainer.group == 0 and len(held) < len(hold_steps) and step >= hold_steps[len(held)]:
            held.append(step)
            deadline = time.monotonic() + hold_s
            while time.monotonic() < deadline and not restarted(trainer.config.run.dir, len(held)):
                time.sleep(0.2)
            time.sleep(settle_s)

    return hook
