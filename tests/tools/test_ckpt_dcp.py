"""DCP both ways: written by dcp.save on 4 gloo ranks -> resilient (only with --trust-pickle) ->
loaded by Checkpointer on 3 ranks; resilient -> DCP -> dcp.load on 2 ranks. Bit for bit."""

from __future__ import annotations

import os

import pytest

from tests.dist import run_world
from tests.storage.reshard_workers import load_world, save_world
from tests.tools.dcp_workers import dcp_load_world, dcp_save_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

N_TENSORS = 5 + 5 * 2 + 5  # model params + (exp_avg, exp_avg_sq) + step per param


def test_dcp_from_four_ranks_into_resilient_loads_on_three(tmp_path, cli):
    dcp_dir, ref, out = str(tmp_path / "dcp"), str(tmp_path / "ref"), str(tmp_path / "ckpt")
    run_world(dcp_save_world, 4, dcp_dir, ref)
    assert os.path.exists(os.path.join(dcp_dir, ".metadata"))

    rc, _, err = cli("convert", dcp_dir, out, "--to", "resilient", "--out-step", "7")
    assert rc == 2 and "--trust-pickle" in err and "arbitrary code" in err and err.count("\n") == 1
    assert not os.path.exists(out)  # refused before anything was written

    result = cli.json("convert", dcp_dir, out, "--to", "resilient", "--out-step", "7", "--trust-pickle")
    assert result["from"] == "dcp" and result["tensors"] == N_TENSORS and result["step"] == 7
    summary = cli.json("inspect", out)
    assert summary["values"]["extra"] == {"value": {"epoch": 3, "tag": "reshard-test"}}  # regrouped JSON
    assert cli.json("verify", out)["ok"]

    for r in run_world(load_world, 3, out, f"{ref}.rank0", "fsdp"):
        assert r["step"] == 7 and r["checked"] == N_TENSORS and r["after_set"] == N_TENSORS
        assert r["extra"] == {"epoch": 3, "tag": "reshard-test"}


def test_resilient_to_dcp_loads_on_two_ranks(tmp_path, cli):
    url, ref, dcp_dir = str(tmp_path / "ckpt"), str(tmp_path / "ref"), str(tmp_path / "dcp")
    run_world(save_world, 0, url, ref, "none")  # one process, no process group: plain tensors
    result = cli.json("convert", url, dcp_dir, "--to", "dcp")
    assert result["tensors"] == N_TENSORS and ".metadata" in result["files"]
    for r in run_world(dcp_load_world, 2, dcp_dir, f"{ref}.rank0"):
        assert r["checked"] == N_TENSORS
        assert r["extra"] == {"epoch": 3, "tag": "reshard-test"} and r["lr"] == pytest.approx(1e-2)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_big_tensors_become_many_dcp_chunks(tmp_path, cli):
    """--max-memory 16MiB streams in 1 MiB blocks: a 4 MiB tensor is written as 4 DCP chunks, and
    dcp.load (single process) reassembles it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from resilient import Checkpointer

    state = {"w": torch.randn(1024, 1024), "b": torch.arange(7, dtype=torch.int32)}
    Checkpointer(str(tmp_path / "ckpt")).save(1, state).wait()
    cli.json("convert", str(tmp_path / "ckpt"), str(tmp_path / "dcp"), "--to", "dcp", "--max-memory", "16MiB")
    chunks = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata["w"].chunks
    assert [list(c.offsets) for c in chunks] == [[0, 0], [256, 0], [512, 0], [768, 0]]
    target = {"w": torch.zeros(1024, 1024), "b": torch.zeros(7, dtype=torch.int32)}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
