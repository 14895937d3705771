"""A damaged newest step falls back to the newest step that loads, and ``checkpoint.load_step``
resumes from a chosen one (issue 13, item 11; ``recovery/restore.py``'s persistent tier).

One process on a temporary file:// root, and two gloo ranks for a step damaged on one rank only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.errors import ConfigError, IntegrityError, RestoreError
from resilient.manifest import MANIFEST, step_dir
from resilient.storage.checkpointer import Checkpointer
from resilient.trainer.checkpoint_config import CheckpointConfig
from tests.dist import run_world
from tests.recovery.policy import events, restore_with, save, snapshot, start_run, tier

pytestmark = pytest.mark.timeout(60)


def _flip_chunk(root: Path, step: int, fqn: str, chunk: str = "0.0") -> None:
    """Flip one data byte of ``fqn``'s shard object ``<chunk>`` of ``step`` (its crc32c then fails),
    found where the manifest says it lies in its pack."""
    manifest = json.loads((root / step_dir(step) / MANIFEST).read_text())
    pack, offset, nbytes = manifest["arrays"][fqn]["shards"][chunk]
    path = root / step_dir(step) / manifest["attempt"] / pack
    data = bytearray(path.read_bytes())
    data[offset + nbytes // 4] ^= 0x5A
    path.write_bytes(data)


def _truncate_manifest(root: Path, step: int) -> None:
    path = root / step_dir(step) / MANIFEST
    path.write_bytes(path.read_bytes()[:40])


def _values(state: dict[str, Any]) -> tuple[float, float, dict]:
    return float(state["model"]["w"][0, 0]), float(state["model"]["z"][0, 0]), state["train"]


@pytest.fixture
def ckpt(tmp_path: Path):
    with Checkpointer(str(tmp_path / "ckpt")) as checkpointer:
        yield checkpointer


def test_a_damaged_newest_step_falls_back_to_the_newest_step_that_loads(tmp_path, ckpt):
    root, run = tmp_path / "ckpt", tmp_path / "run"
    save(ckpt, 2, 4, 6)
    _truncate_manifest(root, 6)
    _flip_chunk(root, 4, "model.z")  # model.w of step 4 loads first, then z fails
    result, caller, said = restore_with(run, ckpt)
    assert (result.source, result.step) == ("persistent", 2)
    # Every tensor and value is step 2's, also what the failed attempt at step 4 had written.
    assert caller.applied is not None and _values(caller.applied) == (2.0, 2.5, {"step": 2, "tokens_seen": 20})
    assert said[0].startswith(f"resumed from step 2 of {ckpt.url}")
    fallbacks = events(run, "restore_fallback")
    assert [(e["group"], e["step"]) for e in fallbacks] == [(0, 6), (0, 4)]
    assert "manifest" in fallbacks[0]["reason"] and "not valid JSON" in fallbacks[0]["reason"]
    assert "checksum mismatch in tensor 'model.z' at step 4" in fallbacks[1]["reason"]
    assert [(e["source"], e["step"]) for e in events(run)] == [("persistent", 2)]
    # The run trains steps 4 and 6 again: the damaged ones are set aside (manifest renamed, kept),
    # and `latest` names the step that loaded (tools would report step 6 as lost after its commit).
    assert ckpt.steps() == [2] and json.loads((root / "latest").read_text()) == {"step": 2}
    assert all((root / f"step-00000000{s}" / "manifest.damaged.json").exists() for s in (4, 6))
    save(ckpt, 4, 6)
    assert ckpt.steps() == [2, 4, 6]


def test_past_a_damaged_step_a_newer_ram_snapshot_of_the_timeline_wins(tmp_path, ckpt):
    run, ram = tmp_path / "run", tier(tmp_path / "store")
    try:
        start_run(run, ckpt, ram)
        save(ckpt, 2, 6)
        snapshot(ram, 4)  # older than step 6, newer than step 2
        _flip_chunk(tmp_path / "ckpt", 6, "model.w")
        result, caller, _ = restore_with(run, ckpt, ram)
    finally:
        ram.close()
    assert (result.source, result.step, result.excluded) == ("own", 4, [])
    assert caller.applied is not None and _values(caller.applied) == (1004.0, 1004.5, {"step": 4, "tokens_seen": 40})
    assert [e["step"] for e in events(run, "restore_fallback")] == [6]


def test_no_step_that_loads_is_one_error_naming_each(tmp_path, ckpt):
    root = tmp_path / "ckpt"
    save(ckpt, 2, 4)
    _flip_chunk(root, 4, "model.w")
    _truncate_manifest(root, 2)
    none_loads = r"none of the 2 committed steps under .* loads; newest first: step 4: "
    with pytest.raises(RestoreError, match=none_loads) as e:
        restore_with(tmp_path / "run", ckpt)
    assert "\n" not in str(e.value) and "; step 2: " in str(e.value) and "verify --all" in str(e.value)
    assert [x["step"] for x in events(tmp_path / "run", "restore_fallback")] == [4, 2]
    assert ckpt.steps() == [2, 4]  # nothing loaded: nothing set aside (a rerun must not start afresh)


def test_load_step_goes_back_once_and_later_ram_snapshots_never_come_back(tmp_path, ckpt):
    run, ram = tmp_path / "run", tier(tmp_path / "store")
    try:
        start_run(run, ckpt, ram)
        save(ckpt, 2, 4)
        snapshot(ram, 5, 6)  # without load_step, RAM step 6 would win
        result, caller, _ = restore_with(run, ckpt, ram, load_step=4)
        assert (result.source, result.step) == ("persistent", 4)
        assert caller.applied is not None and _values(caller.applied)[0] == 4.0
        assert [(e["step"], e["reason"]) for e in result.excluded] == [
            (step, "newer than the step asked for (checkpoint.load_step=4)") for step in (5, 6)
        ]
        assert result.timeline is not None and result.timeline.load_step == 4
        # A restart with the same recipe: load_step was applied, the run goes on; 5 and 6 stay gone.
        again, _, _ = restore_with(run, ckpt, ram, load_step=4)
        assert (again.source, again.step) == ("persistent", 4)
        assert [e["step"] for e in again.excluded] == [5, 6]
        assert all("was abandoned: a restore not from RAM or a load_step began" in e["reason"] for e in again.excluded)
        snapshot(ram, 5)  # the rewound run's own step 5
        third, caller, _ = restore_with(run, ckpt, ram, load_step=4)
        assert (third.source, third.step) == ("own", 5)
        assert third.timeline is not None and again.timeline is not None
        assert (third.timeline.parent, third.timeline.load_step) == (again.timeline.timeline, 4)
        assert caller.applied is not None and _values(caller.applied)[0] == 1005.0
    finally:
        ram.close()


def test_load_step_must_be_committed_the_last_and_loadable(tmp_path, ckpt):
    save(ckpt, 2, 4)
    not_committed = r"checkpoint.load_step=3 is not a committed step under .*; committed steps: 2, 4 "
    with pytest.raises(ConfigError, match=not_committed):
        restore_with(tmp_path / "run", ckpt, load_step=3)
    with pytest.raises(ConfigError, match=r"checkpoint.load_step=2: committed step\(s\) 4 under .* would be saved"):
        restore_with(tmp_path / "run", ckpt, load_step=2)
    _flip_chunk(tmp_path / "ckpt", 4, "model.w")
    with pytest.raises(IntegrityError, match="checksum mismatch in tensor 'model.w' at step 4"):
        restore_with(tmp_path / "run", ckpt, load_step=4)  # the step asked for, or an error: never another
    with pytest.raises(ConfigError, match=r"checkpoint.load_step=-1 is out of range"):
        CheckpointConfig(load_step=-1)
    with pytest.raises(ConfigError, match=r"checkpoint.load_step=2 needs checkpoint.resume=true"):
        CheckpointConfig(load_step=2, resume=False)


# -- two gloo ranks: the damage is in rank 1's shard only -----------------------------------------


def _sharded(step: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(32, dtype=torch.float32).reshape(8, 4) + 100 * step
    return {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}, "train": {"step": step}}


def _save_damage_restore(rank: int, world: int, root: str, run_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.dist import barrier
    from resilient.recovery.restore import restore

    mesh = init_device_mesh("cpu", (world,))
    with Checkpointer(root) as ckpt:
        for step in (2, 4):
            ckpt.save(step, _sharded(step, mesh)).wait()
        barrier()
        if rank == 0:
            _flip_chunk(Path(root), 4, "model.w", chunk="1.0")  # the rows only rank 1 reads
        barrier()
        loaded: dict[str, Any] = {}
        result = restore(lambda: _sharded(0, mesh), loaded.update, checkpointer=ckpt, ram=None, run_dir=run_dir)
    local = loaded["model"]["w"].to_local()
    return {"source": result.source, "step": result.step, "w": local[:, 0].tolist(), "train": loaded["train"]}


@pytest.mark.dist
def test_a_step_damaged_on_one_rank_moves_every_rank_to_the_same_older_step(tmp_path):
    restored = run_world(_save_damage_restore, 2, str(tmp_path / "ckpt"), str(tmp_path / "run"), timeout_s=60)
    rows = [[200.0, 204.0, 208.0, 212.0], [216.0, 220.0, 224.0, 228.0]]
    assert restored == [{"source": "persistent", "step": 2, "w": rows[rank], "train": {"step": 2}} for rank in range(2)]
    (fallback,) = events(tmp_path / "run", "restore_fallback")
    assert fallback["step"] == 4 and fallback["reason"].startswith("[rank 1] checksum mismatch")


def test_a_set_aside_never_touches_a_step_committed_again_and_keeps_the_damaged_data(tmp_path, ckpt):
    import json

    from resilient.storage.retention import KeepLast, plan_retention, set_aside

    root = tmp_path / "ckpt"
    save(ckpt, 2, 4)
    _flip_chunk(root, 4, "model.w")
    damaged = (root / step_dir(4) / MANIFEST).read_bytes()
    assert restore_with(tmp_path / "run", ckpt)[0].step == 2 and ckpt.steps() == [2]
    save(ckpt, 4)  # the run (or another replica group) commits step 4 afresh
    # A late set-aside (a slower group that also fell back past 4) must leave the new commit alone.
    assert set_aside(ckpt.store, 4, damaged) is False and ckpt.steps() == [2, 4]
    # Retention keeps the damaged attempt for inspection, beside the new one.
    old_attempt = json.loads(damaged)["attempt"]
    assert f"{step_dir(4)}/{old_attempt}" not in plan_retention(ckpt.store, KeepLast(2))


def test_a_newer_format_version_is_not_damage_and_is_never_set_aside(tmp_path, ckpt):
    import json

    root = tmp_path / "ckpt"
    save(ckpt, 2, 4)
    manifest = root / step_dir(4) / MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 99}))
    with pytest.raises(ConfigError, match="format version 99.*upgrade resilient"):
        restore_with(tmp_path / "run", ckpt)
    assert ckpt.steps() == [2, 4] and not (root / step_dir(4) / "manifest.damaged.json").exists()


def _bad_read_once_on_rank_1(rank: int, world: int, root: str, run_dir: str) -> dict[str, Any]:
    """Rank 1's first read of step 4 fails its checksum (a flaky NIC or DIMM on its node); the
    stored bytes are intact."""
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.dist import barrier
    from resilient.recovery.restore import restore

    mesh = init_device_mesh("cpu", (world,))
    with Checkpointer(root) as ckpt:
        for step in (2, 4):
            ckpt.save(step, _sharded(step, mesh)).wait()
        barrier()
        real, failures = ckpt._load_local, []

        def flaky(state, chosen, manifest, strict):
            if rank == 1 and chosen == 4 and not failures:
                failures.append(chosen)
                raise IntegrityError(f"checksum mismatch in tensor 'model.w' at step {chosen}, inner chunk {{1, 0}}")
            return real(state, chosen, manifest, strict)

        ckpt._load_local = flaky
        loaded: dict[str, Any] = {}
        result = restore(lambda: _sharded(0, mesh), loaded.update, checkpointer=ckpt, ram=None, run_dir=run_dir)
        steps = ckpt.steps()
    return {"source": result.source, "step": result.step, "train": loaded["train"], "steps": steps}


@pytest.mark.dist
def test_one_ranks_bad_read_is_re_read_elsewhere_and_never_sets_a_good_step_aside(tmp_path):
    # Before: every rank fell back to step 2, and step 4 (intact) was set aside for good.
    restored = run_world(_bad_read_once_on_rank_1, 2, str(tmp_path / "ckpt"), str(tmp_path / "run"), timeout_s=60)
    assert restored == [{"source": "persistent", "step": 4, "train": {"step": 4}, "steps": [2, 4]}] * 2
    assert events(tmp_path / "run", "restore_fallback") == []
    (recheck,) = events(tmp_path / "run", "restore_recheck")
    assert (recheck["step"], recheck["rank"], recheck["intact"]) == (4, 0, True)
