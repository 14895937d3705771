"""``resilient-train``'s arguments are checked before anything starts: no recipe prints the usage,
launcher flags that do not fit the recipe are one line and exit 2 with nothing written; and
``resilient-ckpt --help`` answers without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilient.tools.train import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
HEAVY_MODULES = ("torch", "tensorstore", "ml_dtypes", "zarr")

pytestmark = pytest.mark.timeout(60)


def test_no_arguments_prints_the_usage_and_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: resilient-train"), err
    assert "--config configs/tiny.toml" in err.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []  # nothing trained into ./runs/default


def test_a_recipe_is_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--nproc", "1", "--set", "run.steps=1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("resilient-train: error: --config RECIPE is required")
    assert list(tmp_path.iterdir()) == []


def test_replica_group_size_that_does_not_fit_the_recipe_is_one_line_and_starts_nothing(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    argv = ["--replica-groups", "2", "--nproc-per-group", "3", "--config", TINY, "--set", f"run.dir={run_dir}"]
    argv += ["--set", "parallel.dp_shard=1", "--set", "parallel.tp=1"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --nproc-per-group 3 but parallel.pp x dp_shard x tp = 1 ranks per group")
    assert "use --nproc-per-group 1" in line
    assert not run_dir.exists()  # no logs, no pids, no lighthouse


def test_ckpt_help_imports_no_heavy_module() -> None:
    # Held by what gets imported, not by a clock: torch alone costs seconds on a loaded machine.
    probe = (
        "import sys, contextlib, io\n"
        "from resilient.tools.ckpt import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['convert', '--help'])\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules), 'safetensors' in out.getvalue())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert done.stdout.strip() == "[] True", done.stdout + done.stderr


def test_help_says_what_the_command_does(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "train a recipe here, on several nodes or as replica groups" in " ".join(text.split())
