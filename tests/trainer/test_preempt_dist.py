"""Preemption over real gloo ranks, laid out as two replica groups of two tensor-parallel ranks: the
signal reaches one rank of one group only, and every rank of both groups stops after the same step
(the flags ride on the step's sums: combined over the tp peers, summed across the groups), which the
writing group saves and the other sees committed (``PreemptWatch``, ``StopFlags``, ``stop_preempted``)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.dist import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _settled(root: str, step: int, timeout_s: float) -> list[int]:
    """A group that does not write the stop step: until it is committed (as ``settled_steps``)."""
    from resilient import Checkpointer

    deadline = time.monotonic() + timeout_s
    while step not in (steps := Checkpointer(root).steps()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return steps


def _train_until_preempted(rank: int, world: int, root: str, combine_tp: bool) -> dict:
    import torch.distributed as dist

    from resilient import Checkpointer
    from resilient.trainer.preempt import Preempted, PreemptWatch, save_stop_step, stop_preempted

    group = rank // 2  # replica group 0: ranks 0, 1; group 1: ranks 2, 3
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # torchft: each group rank with its peers
    tp, peers = tp_groups[group], across[rank % 2]
    ckpt = Checkpointer(root, process_group=tp)
    stop: Preempted | None = None
    with PreemptWatch([signal.SIGTERM]) as watch:
        for step in range(1, 50):
            flags = watch.start_flags(tp if combine_tp else None)  # the step starts
            if rank == 3 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # mid-step, one rank of one group: after its flags
            sums = torch.tensor([1.0, *flags.wait()], dtype=torch.float64)  # [loss, flags]
            dist.all_reduce(sums, group=peers)  # across the groups (tp peers share their sums unreduced)
            signum = watch.agreed_signal(sums[1:].tolist())
            if signum and not combine_tp:  # the ranks disagree here: a save would wait for a peer forever
                stop = Preempted(step, signum, committed=False)
                break
            if signum:
                state = {"w": torch.full((64,), float(step)), "step": step}

                def save(step: int = step, state: dict = state) -> None:
                    writes = lambda: group == 0  # noqa: E731 - the participating rank 0's group writes
                    commit = ckpt.save
                    save_stop_step(
                        step, wait=ckpt.wait, committed=ckpt.steps, writes=writes, save=lambda: commit(step, state)
                    )

                stop = stop_preempted(
                    step,
                    signum,
                    save=save,
                    committed=ckpt.steps,
                    settled=lambda step=step: _settled(root, step, 30.0),
                    record=lambda event, **fields: None,
                )
                break
    ckpt.close()
    return {"stop": stop.step if stop else None, "committed": stop.committed if stop else None}


def test_a_signal_on_one_rank_of_one_group_stops_every_group_after_the_same_committed_step(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    results = run_world(_train_until_preempted, 4, root, True)
    assert [r["stop"] for r in results] == [4, 4, 4, 4], results  # the step after the signal's
    assert all(r["committed"] for r in results), results
    from resilient import Checkpointer

    assert Checkpointer(root).steps() == [4]  # written once, by group 0


def test_without_combining_the_tp_peers_flags_the_ranks_would_disagree(tmp_path) -> None:
    # Rank 3's flag reaches rank 1 (its cross-group peer) but not rank 0 nor rank 2: why StopFlags
    # combines the tp peers' flags before they ride on sums those peers do not reduce.
    results = run_world(_train_until_preempted, 4, str(tmp_path / "ckpt"), False)
    assert [r["stop"] for r in results][1::2] == [4, 4] and results[0]["stop"] is None, results
