"""Issue 13 item 4: every rank reaches the same outcome for a save, and an error is raised on every
rank at the same call (real gloo ranks; faults injected inside the rank processes)."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

from tests.dist import outcome, run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _state(rank: int, value: float) -> dict:
    # Replicated tensors are balanced over the ranks: each writes one; both send receipts.
    return {"a": torch.full((8,), value), "b": torch.full((8,), -value), "step": int(value)}


@contextlib.contextmanager
def _patched(module, name: str, value):
    """``module.name = value`` in this rank process for one scenario (the next one gets it back)."""
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield real
    finally:
        setattr(module, name, real)


def _latest_write_fails(rank: int, root: str) -> dict:
    """The manifest is durable, then moving `latest` fails on the coordinator."""
    from resilient import Checkpointer
    from resilient.storage import commit

    def broken_latest(store, step):
        raise OSError("injected: latest not writable")

    with _patched(commit, "update_latest", broken_latest):
        ckpt = Checkpointer(root)
        handle = ckpt.save(1, _state(rank, 1.0))
        result = {"handle": outcome(lambda: handle.wait(timeout=30)), "wait": outcome(ckpt.wait)}
        result["next"] = outcome(lambda: ckpt.save(2, _state(rank, 2.0)).wait(timeout=30))
        result["steps"] = ckpt.steps()
        ckpt.close()
    return result


def _ambiguous_receipt(rank: int, root: str) -> dict:
    """Rank 1's receipt lands but its PUT reports a failure (the response was lost)."""
    from resilient import Checkpointer
    from resilient.storage import persist

    real = persist.write_receipt

    def lost_response(store, attempt_key, r, receipt):
        real(store, attempt_key, r, receipt)
        time.sleep(0.5)  # the client's timeout: the coordinator has the receipt meanwhile
        raise OSError("injected: receipt PUT response lost")

    with _patched(persist, "write_receipt", lost_response if rank == 1 else real):
        ckpt = Checkpointer(root)
        handle = ckpt.save(1, _state(rank, 1.0))
        result = {"handle": outcome(lambda: handle.wait(timeout=30)), "wait": outcome(ckpt.wait)}
        result["steps"] = ckpt.steps()
        ckpt.close()
    return result


def _late_coordinator(rank: int, root: str) -> dict:
    """The coordinator's own persist ends after the commit timeout: rank 1's clock (started when its
    own persist ended, before) ran out while rank 0 then committed."""
    from resilient import Checkpointer, CheckpointerConfig

    if rank == 0:
        os.environ["RESILIENT_FAULTS"] = "persist.regions_written=pause:2.2@rank0"
    ckpt = Checkpointer(root, config=CheckpointerConfig(commit_timeout_s=1.5))
    ckpt.save(1, _state(rank, 1.0))
    result = {"wait": outcome(ckpt.wait)}  # raised here on every rank, or on none
    os.environ.pop("RESILIENT_FAULTS", None)
    ckpt.config.commit_timeout_s = 60.0  # the next save must not depend on this machine's load
    result["next"] = outcome(lambda: ckpt.save(2, _state(rank, 2.0)).wait(timeout=30))
    result["steps"] = ckpt.steps()
    ckpt.close()
    return result


def _one_rank_cannot_read(rank: int, root: str) -> dict:
    """Loading: rank 1's read fails (a corrupt chunk); rank 0's succeeds."""
    import torch.distributed as dist

    from resilient import Checkpointer, IntegrityError
    from resilient.storage import checkpointer as module

    ckpt = Checkpointer(root)
    ckpt.save(1, {"w": torch.arange(8.0)}).wait(timeout=30)

    def corrupt(*args, **kwargs):
        raise IntegrityError("injected: chunk w/0 crc32c mismatch")

    with _patched(module, "read_into", corrupt if rank == 1 else module.read_into):
        result = {"load": outcome(lambda: ckpt.load({"w": torch.zeros(8)}))}
    dist.barrier()  # the next collective: every rank gets here (the old code left rank 0 past it)
    ckpt.close()
    return result


def _different_steps(rank: int, root: str) -> dict:
    """A caller bug: the ranks pass different step numbers (the old code saved each rank's part
    under its own step and the coordinator waited for receipts that never came)."""
    from resilient import Checkpointer, CheckpointerConfig

    ckpt = Checkpointer(root, config=CheckpointerConfig(commit_timeout_s=5.0))  # the old code: fail fast
    result = {"save": outcome(lambda: ckpt.save(1 + rank, _state(rank, 1.0)))}
    result["next"] = outcome(lambda: ckpt.save(3, _state(rank, 3.0)).wait(timeout=30))
    ckpt.close()
    return result


def _scenarios(rank: int, world: int, root: str) -> dict:
    return {
        name: fn(rank, os.path.join(root, name))
        for name, fn in [
            ("latest", _latest_write_fails),
            ("receipt", _ambiguous_receipt),
            ("late", _late_coordinator),
            ("load", _one_rank_cannot_read),
            ("steps", _different_steps),
        ]
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    return run_world(_scenarios, 2, str(tmp_path_factory.mktemp("agree")), timeout_s=100)


def test_a_failed_latest_write_after_the_manifest_is_committed_on_every_rank(outcomes):
    for r in outcomes:
        assert r["latest"] == {"handle": "ok", "wait": "ok", "next": "ok", "steps": [1, 2]}


def test_an_ambiguous_receipt_put_gets_the_coordinators_outcome_on_every_rank(outcomes):
    for r in outcomes:
        assert r["receipt"] == {"handle": "ok", "wait": "ok", "steps": [1]}


def test_commit_timeout_is_measured_from_an_agreed_point_and_raised_together(outcomes):
    first, second = (r["late"] for r in outcomes)
    assert first["wait"] == second["wait"]  # the same error, at the same call
    assert first["wait"].startswith("CommitError: [rank 0 (and 1 other rank(s))] step 1 not committed")
    assert first["next"] == second["next"] == "ok"  # raised once: the next save works
    assert first["steps"] == second["steps"] == [2]


def test_a_read_failing_on_one_rank_fails_the_load_on_every_rank(outcomes):
    first, second = (r["load"]["load"] for r in outcomes)
    assert first == second == "IntegrityError: [rank 1] injected: chunk w/0 crc32c mismatch"


def test_different_steps_on_different_ranks_are_refused_on_every_rank(outcomes):
    first, second = (r["steps"] for r in outcomes)
    assert first["save"] == second["save"]
    assert "save() called with different steps on different ranks: [1, 2]" in first["save"]
    assert first["next"] == second["next"] == "ok"
