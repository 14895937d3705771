"""``resilient-train``'s arguments are checked before anything starts: no recipe prints the usage,
launcher flags that do not fit the recipe are one line and exit 2 with nothing written; and
``resilient-ckpt --help`` answers without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilient.tools import train as train_cli
from resilient.tools.train import main, parse_args

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
HEAVY_MODULES = ("torch", "tensorstore", "ml_dtypes", "zarr")

pytestmark = pytest.mark.timeout(60)


def test_no_arguments_is_one_line_that_says_how_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([])
    (line,) = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and line.startswith("resilient-train: error: give a recipe"), line
    assert "--config configs/tiny.toml" in line and "--help" in line
    assert list(tmp_path.iterdir()) == []  # nothing trained into ./runs/default


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--grace-s", "-1"], "--grace-s must be a finite number of seconds >= 0, got -1.0"),
        (["--grace-s", "nan"], "--grace-s must be a finite number of seconds >= 0"),
        (["--grace-s", "inf"], "--grace-s must be a finite number of seconds >= 0"),
        (["--replica-groups", "2", "--nproc-per-group", "4", "--lighthouse", "notaurl"], "--lighthouse takes the URL"),
        (["--replica-groups", "2", "--nproc-per-group", "4", "--lighthouse", "http://[::1:29510"], "http://HOST:PORT"),
        (["--replica-groups", "2", "--nproc-per-group", "4", "--lighthouse", "http://h:99999"], "http://HOST:PORT"),
    ],
)
def test_launcher_flags_that_do_not_fit_are_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, flags: list[str], says: str
) -> None:
    """Before: a negative grace was taken, and a lighthouse that is no URL was found only by the
    groups (restarted, then "a replica group exited with 1")."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["--config", TINY, *flags])
    (line,) = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and line.startswith("resilient-train: error: ") and says in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("groups", [[], ["--replica-groups", "2", "--nproc-per-group", "4"]])
def test_a_run_dir_that_cannot_be_made_is_one_line_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, groups: list[str]
) -> None:
    def started(*args: object, **kwargs: object) -> int:
        raise AssertionError("a launch started")

    monkeypatch.setattr(train_cli, "run", started)
    monkeypatch.setattr(train_cli, "run_replicated", started)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_dir = blocker / "run"
    assert main(["--config", TINY, "--set", f"run.dir={run_dir}", *groups]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: run.dir {run_dir} cannot be written (Not a directory"), line


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


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:29510", "http://lighthouse", "https://lh.example.com", "http://[::1]:29510", "http://h:1/x"],
)
def test_a_lighthouse_url_torchft_takes_is_taken(url: str) -> None:
    args = parse_args(["--config", TINY, "--replica-groups", "2", "--nproc-per-group", "4", "--lighthouse", url])
    assert args.lighthouse == url
