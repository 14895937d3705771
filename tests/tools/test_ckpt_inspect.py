"""``ls`` and ``inspect`` on local and S3 checkpoints (JSON parsed and checked), and bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from resilient import Checkpointer
from tests.tools.conftest import mixed_state

pytestmark = pytest.mark.timeout(120)


def _make_debris(root: str) -> None:
    """An orphan attempt in committed step 5 and a step 9 whose save never committed."""
    for d in ("step-000000005/attempt-deadbeef00000000", "step-000000009/attempt-cafe000000000000/receipts"):
        os.makedirs(os.path.join(root, d))
        with open(os.path.join(root, d, "x"), "w") as f:
            f.write("partial")


def _check_ls(listing: dict, root_url: str) -> None:
    assert listing["root"] == root_url and listing["latest"] == 5
    steps = {s["step"]: s for s in listing["steps"]}
    assert steps[3]["committed"] and steps[5]["committed"]
    assert steps[5]["tensors"] == 5 and steps[5]["bytes"] == 96 * 40 * 4 + 40 * 24 * 2 + 8 + 10 * 8
    assert steps[5]["attempt"].startswith("attempt-") and steps[5]["created_at"].endswith("Z")


def _check_inspect(summary: dict) -> None:
    assert summary["step"] == 5 and summary["format_version"] == 3 and summary["world_size"] == 1
    tensors = {t["fqn"]: t for t in summary["tensors"]}
    assert tensors["model.embed.weight"]["shape"] == [96, 40] and tensors["model.embed.weight"]["dtype"] == "float32"
    assert tensors["model.proj.weight"]["dtype"] == "bfloat16" and tensors["model.proj.weight"]["bytes"] == 1920
    assert tensors["optim.step"]["shape"] == [] and tensors["model.proj.bias"]["shape"] == [0, 3]
    assert all(t["shard_shape"] and len(t["inner_shape"]) == len(t["shape"]) for t in summary["tensors"] if t["shape"])
    assert summary["values"]["data"] == {"value": {"rows_consumed": 4096, "seed": 7}}
    assert summary["values"]["tags"] == {"value": ["a", "b"]}


def test_ls_and_inspect_local(tmp_path, cli):
    root = str(tmp_path / "ckpt")
    ckpt = Checkpointer(root)
    ckpt.save(3, mixed_state()).wait()
    ckpt.save(5, mixed_state(2.0)).wait()
    _make_debris(root)
    listing = cli.json("ls", root)
    _check_ls(listing, root)
    steps = {s["step"]: s for s in listing["steps"]}
    assert steps[5]["orphan_attempts"] == ["attempt-deadbeef00000000"] and steps[3]["orphan_attempts"] == []
    assert not steps[9]["committed"] and "uncommitted" in steps[9]["problem"]
    rc, out, _ = cli("ls", root)
    assert rc == 0 and "UNCOMMITTED" in out and "orphan attempt attempt-deadbeef00000000" in out

    _check_inspect(cli.json("inspect", root))  # a root: its newest committed step (not the uncommitted 9)
    only = cli.json("inspect", os.path.join(root, "step-000000003"), "--tensors", "model.*")
    assert only["step"] == 3 and {t["fqn"] for t in only["tensors"]} == {
        "model.embed.weight",
        "model.proj.weight",
        "model.proj.bias",
    }
    rc, out, _ = cli("inspect", root, "--step", "3")
    assert rc == 0 and "model.embed.weight" in out and "96x40" in out


def test_ls_and_inspect_s3(s3_bucket, cli):
    url = f"s3://{s3_bucket}/run"
    ckpt = Checkpointer(url)
    ckpt.save(3, mixed_state()).wait()
    ckpt.save(5, mixed_state(2.0)).wait()
    _check_ls(cli.json("ls", url), url)
    _check_inspect(cli.json("inspect", url))
    assert cli.json("inspect", f"{url}/step-000000003")["step"] == 3
    assert [s["step"] for s in cli.json("verify", url, "--all")["steps"]] == [3, 5]
    rc, _, err = cli("ls", f"s3://{s3_bucket}-missing/run")
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1


def _one_line_error(cli, *argv: str) -> str:
    rc, out, err = cli(*argv)
    assert rc == 2, (rc, out, err)
    assert err.count("\n") == 1 and err.startswith("resilient-ckpt"), err
    return err


def test_bad_input_is_exit_2_with_one_line(tmp_path, saved, cli):
    root, _ = saved
    assert "does not exist" in _one_line_error(cli, "ls", str(tmp_path / "nowhere"))
    assert "unsupported checkpoint URL" in _one_line_error(cli, "inspect", "gs://bucket/x")
    (tmp_path / "empty").mkdir()
    assert "not a resilient checkpoint" in _one_line_error(cli, "inspect", str(tmp_path / "empty"))
    assert "not a resilient checkpoint" in _one_line_error(cli, "verify", str(tmp_path / "empty"))
    assert "step 99 is not committed" in _one_line_error(cli, "inspect", root, "--step", "99")
    assert "step 99 is not committed" in _one_line_error(cli, "verify", os.path.join(root, "step-000000099"))
    (tmp_path / "notes.txt").write_text("hello")
    assert "cannot tell the format" in _one_line_error(
        cli, "convert", str(tmp_path / "notes.txt"), str(tmp_path / "out"), "--to", "resilient"
    )
    assert "invalid choice: 'xyz'" in _one_line_error(cli, "convert", root, str(tmp_path / "out"), "--to", "xyz")
    assert "the following arguments are required" in _one_line_error(cli, "prune", root)
    assert "not an empty directory" in _one_line_error(cli, "convert", root, str(tmp_path), "--to", "safetensors")


def test_more_bad_input_says_what_to_do(tmp_path, saved, cli):
    root, _ = saved
    (tmp_path / "empty").mkdir()
    assert "check the URL" in _one_line_error(cli, "ls", str(tmp_path / "empty"))
    for atol in ("-1", "nan", "inf", "abc"):
        err = _one_line_error(cli, "diff", root, root, "--atol", atol)
        assert f"argument --atol: must be a finite number >= 0, e.g. 1e-6, got '{atol}'" in err
    # A glob with a typo matched nothing, and verify said "OK (0 tensors)", diff "identical", exit 0.
    for argv in (("inspect", root), ("verify", root), ("diff", root, root)):
        err = _one_line_error(cli, *argv, "--tensors", "modle.*")
        assert "--tensors modle.* matches no tensor or value of" in err and "model.embed.weight" in err
    rc, out, _ = cli("verify", root, "--tensors", "model.*")
    assert rc == 0 and "OK (3 tensors" in out


def test_a_damaged_newest_step_names_the_older_one_that_reads(tmp_path, cli):
    root = str(tmp_path / "ckpt")
    ckpt = Checkpointer(root)
    for step in (5, 10):
        ckpt.save(step, mixed_state()).wait()
    manifest = tmp_path / "ckpt" / "step-000000010" / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    for argv in (("convert", root, str(tmp_path / "out"), "--to", "safetensors"), ("diff", root, root)):
        rc, _, err = cli(*argv)
        assert rc == 1 and err.count("\n") == 1, err  # a damaged step is a finding
        assert "step-000000010/manifest.json is not valid JSON" in err
        assert err.rstrip().endswith(f"the newest older step that reads is 5: use it ({root}/step-000000005)")
    rc, _, err = cli("diff", root, os.path.join(root, "step-000000005"))
    assert rc == 1 and "is not valid JSON" in err


@pytest.mark.e2e  # a CLI process whose reader is gone before it writes
def test_a_reader_that_went_away_is_no_error(saved):
    root, _ = saved
    command = [sys.executable, "-m", "resilient.tools.ckpt", "inspect", root]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `resilient-ckpt inspect ROOT | head -1`, head already done
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (141, b""), err  # as a shell reports a SIGPIPE death; no error line
