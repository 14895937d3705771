"""Preemption over real gloo ranks: the signal reaches one rank only, and every rank stops at the
same step, which is saved and committed once (``PreemptWatch.agreed``, ``save_stop_step``)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.dist import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _train_until_preempted(rank: int, world: int, root: str) -> dict:
    from resilient import Checkpointer
    from resilient.recovery.restore import committed_steps
    from resilient.trainer.preempt import Preempted, PreemptWatch, save_stop_step, stop_preempted

    ckpt = Checkpointer(root)
    events: list[dict] = []
    with PreemptWatch([signal.SIGTERM]) as watch:
        for step in range(50):
            signum = watch.agreed()  # before the step, as the trainer's loop does
            if signum:
                state = {"w": torch.full((64,), float(step)), "step": step}

                def save(step: int = step, state: dict = state) -> None:
                    save_stop_step(
                        step,
                        wait=ckpt.wait,
                        committed=lambda: committed_steps(ckpt),
                        writes=lambda: True,
                        save=lambda: ckpt.save(step, state),
                    )

                stop = stop_preempted(
                    step,
                    signum,
                    save=save,
                    committed=lambda: committed_steps(ckpt),
                    record=lambda event, **fields: events.append(fields),
                )
                break
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # only this rank: as a signal reaching one node first
    ckpt.close()
    assert isinstance(stop, Preempted)
    return {"stop": stop.step, "received": watch.received, "events": events, "steps": Checkpointer(root).steps()}


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_committed_step(tmp_path) -> None:
    results = run_world(_train_until_preempted, 2, str(tmp_path / "ckpt"))
    assert [r["stop"] for r in results] == [4, 4], results  # agreed at the check after rank 1's step 3
    assert [r["received"] for r in results] == [0, signal.SIGTERM]
    assert all(r["steps"] == [4] for r in results), results
    assert all(r["events"][0]["committed"] is True and r["events"][0]["signal"] == "SIGTERM" for r in results)
