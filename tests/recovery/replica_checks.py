"""What the replica-group end-to-end tests check of a finished run's files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from resilient.runfiles import read_jsonl_by_step


def check_exactly_once(run_dir: Path, steps: int, groups: int = 2) -> dict[int, list[str]]:
    """Every step 1..steps was committed with ONE global batch (groups that committed a step agree
    on it), and no sample appears twice within an epoch; every complete epoch is fully covered."""
    by_step: dict[int, list[str]] = {}
    for group in range(groups):
        for step, record in read_jsonl_by_step(str(run_dir / f"group{group}" / "samples.jsonl")).items():
            if step in by_step:
                assert by_step[step] == record["sample_ids"], f"groups disagree on the samples of step {step}"
            by_step[step] = record["sample_ids"]
    assert sorted(by_step) == list(range(1, steps + 1))
    seen = Counter(sid for ids in by_step.values() for sid in ids)
    assert max(seen.values()) == 1, [sid for sid, n in seen.items() if n > 1]
    config = json.loads((run_dir / "group0" / "config.json").read_text())
    num_samples = config["data"]["num_samples"]
    epochs = Counter(int(sid.split(":")[0]) for sid in seen)
    last = max(epochs)
    assert all(epochs[e] == num_samples for e in range(last)), epochs
    return by_step
