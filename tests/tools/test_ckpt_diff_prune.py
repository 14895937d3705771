"""``diff`` of two steps of a training run, ``prune`` (dry run and real), and ``reshard``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from resilient import Checkpointer
from tests.tools.conftest import assert_same_state, zeros_like_state

pytestmark = pytest.mark.timeout(120)


def _train_and_save(root: str, steps: list[int]) -> Checkpointer:
    """A linear model trained with SGD; its state saved at the given steps (weights change each step)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root)
    for step in range(1, max(steps) + 1):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in steps:
            state = {"model": model.state_dict(), "frozen": torch.ones(4), "train": {"step": step}}
            ckpt.save(step, state).wait()
    return ckpt


def test_diff_reports_changed_tensors(tmp_path, cli):
    root = str(tmp_path / "run")
    _train_and_save(root, [1, 2])
    a, b = os.path.join(root, "step-000000001"), os.path.join(root, "step-000000002")
    result = cli.json("diff", a, b, expect=1)
    changed = {c["fqn"]: c for c in result["changed"]}
    assert set(changed) == {"model.weight", "model.bias"} and result["unchanged"] == 1  # "frozen" is equal
    assert changed["model.weight"]["numel"] == 512 and 0 < changed["model.weight"]["changed_elements"] <= 512
    assert changed["model.weight"]["max_abs_diff"] > 0 and result["values_changed"] == ["train"]
    assert not result["identical"] and result["added"] == [] and result["removed"] == []
    rc, out, _ = cli("diff", a, b)
    assert rc == 1 and "~ model.weight" in out and "DIFFERENT" in out
    # A huge tolerance hides the weight changes, but the step counter still differs.
    assert cli.json("diff", a, b, "--atol", "1e6", expect=1)["changed"] == []
    assert cli.json("diff", a, b, "--tensors", "frozen")["identical"]

    same = cli.json("diff", root, root)
    assert same["identical"] and same["unchanged"] == 3
    rc, out, _ = cli("diff", a, a)
    assert rc == 0 and "identical" in out


def _debris(root: str, rel: str) -> None:
    os.makedirs(os.path.join(root, rel))
    with open(os.path.join(root, rel, "x"), "w") as f:
        f.write("partial")


def _tree(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_prune_dry_run_and_real(tmp_path, cli):
    root = str(tmp_path / "run")
    ckpt = _train_and_save(root, [1, 2, 3, 5])
    _debris(root, "step-000000003/attempt-0rphan0000000000")  # orphan of a kept step
    _debris(root, "step-000000004/attempt-dead000000000000")  # uncommitted, older than the newest
    _debris(root, "step-000000006/attempt-busy000000000000")  # newer than latest: maybe saving now
    before = _tree(root)

    plan = cli.json("prune", root, "--keep-last", "2", "--dry-run")
    assert _tree(root) == before and plan["deleted"] == []
    assert plan["planned"] == [
        "step-000000001",
        "step-000000002",
        "step-000000004",
        "step-000000003/attempt-0rphan0000000000",
    ]
    assert plan["kept_committed"] == [3, 5]

    done = cli.json("prune", root, "--keep-last", "2")
    assert done["deleted"] == plan["planned"]
    assert ckpt.steps() == [3, 5]
    left = {p.split("/")[0] for p in _tree(root)}
    assert left == {"latest", "step-000000003", "step-000000005", "step-000000006"}
    assert not os.path.exists(os.path.join(root, "step-000000003", "attempt-0rphan0000000000"))
    target = {
        "model": {"weight": torch.zeros(16, 32), "bias": torch.zeros(16)},
        "frozen": torch.zeros(4),
        "train": None,
    }
    assert ckpt.load(target, step=3) == 3 and target["train"] == {"step": 3}

    # `latest` is advisory and may lag (a kill between manifest and pointer): never prune at or past it.
    with open(os.path.join(root, "latest"), "w") as f:
        json.dump({"step": 3}, f)
    stale = cli.json("prune", root, "--keep-last", "1")
    assert stale["deleted"] == [] and stale["spared"] == ["step-000000003"] and ckpt.steps() == [3, 5]
    rc, _, err = cli("prune", root, "--keep-last", "0")
    assert (
        rc == 2
        and err == "resilient-ckpt: error: --keep-last must be at least 1 (keep_last=0 would delete every step)\n"
    )


def test_reshard_to_mesh_and_explicit_chunks(tmp_path, saved, cli):
    root, state = saved
    for name, args in (
        ("mesh", ["--mesh", "dp_shard=4,tp=2"]),
        ("chunks", ["--chunks", "model.embed.weight=32x40:8x40"]),
    ):
        out = str(tmp_path / name)
        result = cli.json("reshard", root, out, *args)
        assert result["step"] == 5 and result["resharded_from"]["step"] == 5
        summary = cli.json("inspect", out)
        embed = next(t for t in summary["tensors"] if t["fqn"] == "model.embed.weight")
        # dp_shard=4 splits the 96 rows of a plain tensor into 4 boxes of 24 (FSDP2's dim 0).
        assert (embed["shard_shape"], embed["inner_shape"]) == (
            ([24, 40], [24, 40]) if name == "mesh" else ([32, 40], [8, 40])
        )
        assert embed["regions"] == (4 if name == "mesh" else 3)
        assert summary["metadata"]["resharded_from"]["url"].endswith("step-000000005")
        assert cli.json("verify", out)["ok"]  # checksums recomputed
        assert cli.json("diff", root, out)["identical"]
        loaded = zeros_like_state(state)
        Checkpointer(out).load(loaded)
        assert_same_state(loaded, state)
    rc, _, err = cli("reshard", root, str(tmp_path / "bad"), "--chunks", "model.embed.weight=7x7:2x7")
    assert rc == 2 and "must divide" in err


def test_a_damaged_old_manifest_never_fails_later_commits_nor_prune(tmp_path, cli):
    """Issue 13 item 6: a truncated manifest of a kept step made retention raise JSONDecodeError,
    so every later commit was reported failed, and prune crashed on the same root."""
    root = str(tmp_path / "run")
    ckpt = _train_and_save(root, [1, 2])
    manifest = os.path.join(root, "step-000000001", "manifest.json")
    with open(manifest, "r+") as f:
        f.truncate(20)
    _debris(root, "step-000000001/attempt-0rphan0000000000")
    state = {
        "model": {"weight": torch.ones(16, 32), "bias": torch.ones(16)},
        "frozen": torch.ones(4),
        "train": {"step": 3},
    }
    ckpt.save(3, state).wait()  # retention (keep every step) runs after this commit and must not fail it
    assert ckpt.steps() == [1, 2, 3]

    plan = cli.json("prune", root, "--keep-last", "5", "--dry-run")
    assert (
        plan["damaged"] == [1] and plan["planned"] == []
    )  # its orphan is left alone: which attempt is real is unknown
    rc, out, _ = cli("prune", root, "--keep-last", "2")
    assert rc == 0 and "damaged step 1" not in out  # step 1 is now past keep_last: deleted whole
    assert ckpt.steps() == [2, 3]


def _saved_on_mesh(root: str, placements: dict[str, list[str]]) -> None:
    """Rewrite step 5's manifest as if the tensors had been saved as DTensors on a 2x2
    (dp_shard, tp) mesh with these placements (the regions, and so the data, stay as written)."""
    path = os.path.join(root, "step-000000005", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    for fqn, placement in placements.items():
        entry = manifest["arrays"][fqn]
        entry.update(placements=placement, mesh_shape=[2, 2], mesh_dim_names=["dp_shard", "tp"])
    with open(path, "w") as f:
        json.dump(manifest, f)


def test_reshard_knows_the_trainers_mesh_dims():
    """storage may not import the trainer: the offline reshard keeps its own copy of the names."""
    from resilient.storage.offline.reshard import KNOWN_DIM_NAMES
    from resilient.trainer.parallelize import MESH_DIM_NAMES

    assert KNOWN_DIM_NAMES == MESH_DIM_NAMES


def test_reshard_mesh_with_pp_lays_out_as_without_it(tmp_path, saved, cli):
    """pp splits layers, not tensors: the save-time mesh inspect prints (with pp) is a valid target."""
    root, _ = saved
    _saved_on_mesh(root, {"model.embed.weight": ["S(0)", "R"], "model.proj.weight": ["S(0)", "S(1)"]})
    with_pp = cli.json("reshard", root, str(tmp_path / "pp"), "--mesh", "pp=2,dp_shard=4,tp=2")
    without = cli.json("reshard", root, str(tmp_path / "flat"), "--mesh", "dp_shard=4,tp=2")
    assert with_pp["not_applied"] == without["not_applied"]
    assert all(g["dim"] != "pp" for g in with_pp["not_applied"])
    assert [(d["dim"], d["size"]) for d in with_pp["splits_no_tensor"]] == [("pp", 2)]  # named, not ignored
    assert without["splits_no_tensor"] == []
    rc, said, _ = cli("reshard", root, str(tmp_path / "pp-text"), "--mesh", "pp=2,dp_shard=4,tp=2")
    assert rc == 0 and "note: pp=2 splits no tensor: pipeline stages split the layers" in said
    shards = {
        name: {t["fqn"]: t["shard_shape"] for t in cli.json("inspect", str(tmp_path / name))["tensors"]}
        for name in ("pp", "flat")
    }
    assert shards["pp"] == shards["flat"]


def test_reshard_mesh_names_checked_not_applied_named_meshes_recorded(tmp_path, saved, cli):
    """Issue 13 item 13: an unknown --mesh name was accepted and split nothing; a dim that splits
    no tensor said nothing; metadata recorded the target mesh as resharded_from.mesh."""
    root, _ = saved
    _saved_on_mesh(root, {"model.embed.weight": ["S(0)", "R"], "model.proj.weight": ["S(0)", "S(1)"]})
    rc, out, err = cli("reshard", root, str(tmp_path / "typo"), "--mesh", "dp_shard=4,tp_size=2")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("resilient-ckpt: error: --mesh dimension 'tp_size' is unknown; known: dp_shard, tp")
    assert not os.path.exists(tmp_path / "typo")

    result = cli.json("reshard", root, str(tmp_path / "out"), "--mesh", "dp_shard=4,tp=2")
    assert result["resharded_from"]["mesh"] == {"dp_shard": 2, "tp": 2}
    assert result["resharded_from"]["world_size"] == 1 and result["resharded_to"] == {"mesh": {"dp_shard": 4, "tp": 2}}
    metadata = cli.json("inspect", str(tmp_path / "out"))["metadata"]
    assert metadata["resharded_from"]["mesh"] == {"dp_shard": 2, "tp": 2}
    assert metadata["resharded_to"] == {"mesh": {"dp_shard": 4, "tp": 2}}
    groups = {(g["dim"], g["reason"]): g["tensors"] for g in result["not_applied"]}
    assert groups == {
        ("tp", "placed R (not sharded) over tp when saved"): ["model.embed.weight"],
        ("tp", "saved without a device mesh: only dp_shard splits such a tensor (dim 0, as FSDP2)"): [
            "model.proj.bias",
            "optim.ids",
        ],
    }
    rc, out, _ = cli("reshard", root, str(tmp_path / "text"), "--mesh", "dp_shard=4,tp=2")
    lines = out.splitlines()
    assert rc == 0 and lines[1] == "  from step 5 saved on dp_shard=2 x tp=2 (1 rank(s)) to dp_shard=4 x tp=2"
    assert (
        lines[2]
        == "  note: tp=2 does not apply to 1 tensor(s), placed R (not sharded) over tp when saved: model.embed.weight"
    )
