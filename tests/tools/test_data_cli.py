"""``resilient-data build`` as a user runs it (a subprocess): exit codes, one-line errors, the
summary line; and ``python -m resilient.tools.media_corpus``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from resilient.tools.media_corpus import write_corpus

pytestmark = pytest.mark.timeout(60)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resilient.tools.data", *args], capture_output=True, text=True, timeout=50
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_a_missing_src_is_one_line_and_exit_2(tmp_path) -> None:
    line = _one_error_line(_run("build", str(tmp_path / "absent"), "--out", str(tmp_path / "out")))
    assert line.startswith("resilient-data: error: SRC ") and "does not exist" in line
    assert not (tmp_path / "out").exists()


def test_an_empty_folder_is_one_line_and_exit_2(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    line = _one_error_line(_run("build", str(tmp_path / "empty"), "--out", str(tmp_path / "out")))
    assert "is empty" in line and str(tmp_path / "empty") in line


def test_bad_flags_are_one_line_and_exit_2(tmp_path) -> None:
    line = _one_error_line(_run("build", str(tmp_path), "--out", str(tmp_path / "o"), "--shard-size", "12XB"))
    assert "--shard-size" in line and "not a size" in line
    line = _one_error_line(_run("build", str(tmp_path), "--out", str(tmp_path / "o"), "--frobnicate"))
    assert "unrecognized arguments: --frobnicate" in line


def test_a_build_exits_0_with_skips_and_prints_one_summary_line(tmp_path) -> None:
    corpus = tmp_path / "corpus"
    assert (
        subprocess.run(
            [sys.executable, "-m", "resilient.tools.media_corpus", str(corpus), "--clips", "5", "--seed", "3"],
            capture_output=True,
            timeout=50,
        ).returncode
        == 0
    )
    out = tmp_path / "shards"
    result = _run("build", str(corpus), "--out", str(out), "--shard-size", "64KiB", "--workers", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("resilient-data: 4 samples, ") and " 1 skipped, " in lines[0]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 4 and manifest["skipped"] == 1
    again = _one_error_line(_run("build", str(corpus), "--out", str(out)))
    assert "is not empty" in again  # never writes over an earlier build


def test_write_corpus_makes_the_promised_mix(tmp_path) -> None:
    paths = write_corpus(str(tmp_path), clips=8, seed=1)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == sorted(os.listdir(tmp_path)) and len(names) == 16
    exts = [n.rsplit(".", 1)[1] for n in names]
    assert exts.count("mp4") == 5 and exts.count("flac") == 2 and exts.count("wav") == 1
    assert exts.count("txt") == 5 and exts.count("json") == 3  # the corrupt clip's caption is a .txt
    timed = json.loads((tmp_path / "clip01.json").read_text())
    assert timed["text"] == "" and [s["start"] for s in timed["segments"]] == sorted(
        s["start"] for s in timed["segments"]
    )


def test_an_out_that_cannot_be_created_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    from resilient.tools.data import main

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.wav").write_bytes(b"")
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "shards"
    assert main(["build", str(tmp_path / "src"), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0] == (
        f"resilient-data: error: --out {str(out)!r} cannot be created (Not a directory); "
        "give a folder this user can write"
    )
