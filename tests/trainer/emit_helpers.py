"""What the ``--emit`` tests share: the recipe, an ``EmitSpec``'s arguments, stub ``srun`` /
``scontrol`` / ``resilient-train`` on PATH, and the trainer container of a JobSet manifest."""

from __future__ import annotations

import os
import stat
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
SPEC = dict(job_name="omni", nproc_per_node=4, gpus_per_node=4, shm_size="32Gi", trainer_args=["--config", "r.toml"])


def stub(folder: Path, name: str, body: str) -> None:
    """An executable bash script ``folder/name`` running ``body``."""
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def stubs(tmp_path: Path) -> dict[str, str]:
    """PATH with fake ``scontrol``, ``srun`` (runs the command once per node, SLURM_NODEID=0..1) and
    ``resilient-train`` (writes its environment of interest and argv to ``<out>/node-<id>``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A long host list: the script must read the first name without killing the writer by SIGPIPE
    # (pipefail would turn that into a failed job).
    stub(bin_dir, "scontrol", 'printf "gpu-a17\\ngpu-a18\\n"\nseq 1 200000 | sed s/^/gpu-b/\n')
    each_node = (
        "while [[ $1 == --* ]]; do shift; done\n"
        'for n in 0 1; do SLURM_NODEID=$n SLURMD_NODENAME=gpu-a1$((7 + n)) "$@" || exit; done\n'
    )
    stub(bin_dir, "srun", each_node)
    record = 'out="$OUT/node-$RESILIENT_NODE_ID"\nprintf "%s\\n" "$RESILIENT_NODE_ID" "$@" > "$out"\n'
    stub(bin_dir, "resilient-train", record)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path)}


def trainer_container(manifest: dict) -> dict:
    """The trainer container of a JobSet manifest, with its pod spec under ``"pod"``."""
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    return {"pod": pod, **trainer}
