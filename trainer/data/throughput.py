"""Loader throughput: rows per second the pipeline delivers to a trainer that only fetches.

Run as ``python -m resilient.trainer.data.throughput --workers 2 --steps 20``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from resilient.trainer.data.config import DataConfig
from resilient.trainer.data.pipeline import OmniPipeline
from resilient.trainer.data.stream import batch_token_fill


def measure_throughput(config: DataConfig, steps: int) -> dict[str, Any]:
    """Fetch-and-commit ``steps`` global batches (after one warm-up batch) and time them."""
    with OmniPipeline(config) as pipe:
        pipe.next_batch()  # starts the workers and builds the epoch plan: not steady state
        fills = []
        start = time.perf_counter()
        for _ in range(steps):
            pipe.commit_step()
            fills.append(batch_token_fill(pipe.next_batch()))
        seconds = time.perf_counter() - start
    rows = steps * config.global_rows
    return {
        "metric": "loader_rows_per_s",
        "rows_per_s": round(rows / seconds, 1),
        "tokens_per_s": round(rows * config.row_len / seconds),
        "rows": rows,
        "seconds": round(seconds, 3),
        "num_workers": config.num_workers,
        "row_len": config.row_len,
        "global_rows": config.global_rows,
        "token_fill": round(sum(fills) / len(fills), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    config = dataclasses.replace(DataConfig(), num_workers=args.workers)
    print(json.dumps(measure_throughput(config, args.steps)))


if __name__ == "__main__":
    main()
