"""Packing variable-length samples into fixed-length rows, as a pure function of (seed, epoch).

Each epoch visits every sample once, in a seeded permutation. The permutation is cut into windows
of ``packing_window`` consecutive samples and each window is packed first-fit decreasing: its
samples are taken longest first (ties in permutation order), and each goes into the first row of
the window that still has room, else opens a new row. Windows keep packing local (a sample is never
held back more than one window, so the order stays close to the permutation) while giving
first-fit enough choice to fill rows; taking long samples first leaves the short ones to fill the
gaps (default settings: 96% token fill, against 91% for plain first-fit in permutation order).
Rows are emitted window by window, in the order they were opened.

A sample longer than ``row_len`` gets a row of its own and is truncated to ``row_len`` tokens (its
tail, usually the caption, is dropped); the defaults never produce one (longest sample: 283 tokens
for row_len 512). ``DataConfig.max_sample_tokens`` says whether a configuration can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from resilient.trainer.data import hashing

_ORDER_STREAM = 100
"""Hash stream of the epoch permutation (source.py uses 1..7)."""


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The epoch's permutation of sample indices: sorted by a hash of (seed, epoch, index).

    A hash sort rather than ``Generator.permutation``: numpy does not promise the same stream
    across releases, and a resumed run must see the same order after an upgrade.
    """
    keys = hashing.hash64(seed, _ORDER_STREAM, epoch, np.arange(num_samples, dtype=np.int64))
    return np.argsort(keys, kind="stable")


def first_fit(costs: Sequence[int], row_len: int) -> list[list[int]]:
    """Rows of positions into ``costs``; each cost is placed in the first row with room.

    Costs above row_len count as row_len (the sample is truncated), so they fill a fresh row.
    """
    rooms: list[int] = []
    rows: list[list[int]] = []
    for position, cost in enumerate(costs):
        cost = min(cost, row_len)
        for row, room in enumerate(rooms):
            if cost <= room:
                rooms[row] -= cost
                rows[row].append(position)
                break
        else:
            rooms.append(row_len - cost)
            rows.append([position])
    return rows


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """Which samples each row of one epoch holds, stored flat (CSR) to stay small."""

    epoch: int
    row_len: int
    row_starts: np.ndarray
    """int64 [num_rows + 1]: row r holds samples[row_starts[r]:row_starts[r + 1]]."""
    samples: np.ndarray
    """int64 [num_samples]: sample indices in row order, documents in order within a row."""
    row_tokens: np.ndarray
    """int64 [num_rows]: tokens kept in each row (the rest is padding)."""

    @property
    def num_rows(self) -> int:
        return len(self.row_tokens)

    def row_samples(self, row: int) -> np.ndarray:
        return self.samples[self.row_starts[row] : self.row_starts[row + 1]]

    @property
    def token_fill(self) -> float:
        """Fraction of the epoch's row slots that hold a token rather than padding."""
        return float(self.row_tokens.sum()) / (self.num_rows * self.row_len)


def plan_epoch(token_counts: np.ndarray, *, seed: int, epoch: int, row_len: int, packing_window: int) -> EpochPlan:
    """Pack one epoch; token_counts[i] is the length of sample i (all samples of the epoch)."""
    order = epoch_order(seed, epoch, len(token_counts))
    kept = np.minimum(token_counts, row_len)
    rows: list[np.ndarray] = []
    for start in range(0, len(order), packing_window):
        window = order[start : start + packing_window]
        longest_first = window[np.argsort(-kept[window], kind="stable")]
        for positions in first_fit(kept[longest_first].tolist(), row_len):
            rows.append(longest_first[positions])
    sizes = np.asarray([len(row) for row in rows], dtype=np.int64)
    samples = np.concatenate(rows).astype(np.int64)
    row_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    row_tokens = np.add.reduceat(kept[samples], row_starts[:-1]).astype(np.int64)
    return EpochPlan(epoch=epoch, row_len=row_len, row_starts=row_starts, samples=samples, row_tokens=row_tokens)
