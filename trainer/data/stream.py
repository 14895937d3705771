"""The row stream: every row and every share of a global batch as a pure function of its address.

A row's address is a ``RowKey(epoch, row)``. The stream is the rows of epoch 0, then those of
epoch 1, and so on; a global batch of ``global_rows`` rows may run over an epoch's end into the
next epoch, so no row is skipped or padded at epoch boundaries and every sample is seen exactly
once per epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from resilient.errors import ConfigError
from resilient.trainer.data.config import DataConfig
from resilient.trainer.data.packing import EpochPlan, plan_epoch
from resilient.trainer.data.source import OmniSource
from resilient.trainer.data.tokens import PAD, TokenizedSample, tokenize

Batch = dict[str, Any]
"""text_tokens, audio_frames, video_patches, modality, positions, doc_ids (tensors [B, L, ...]),
sample_ids (list[list[str]]) and skipped (list of {sample_id, reason}); see ``RowStream.batch``."""

_CACHED_PLANS = 4
"""Epoch plans kept per process: the current epoch, the next, and a little slack."""


class RowKey(NamedTuple):
    """Address of one packed row: its epoch and its index within the epoch."""

    epoch: int
    row: int


def sample_id(epoch: int, name: str | int) -> str:
    """The id logged for a sample seen in an epoch (``samples.jsonl``): ``<epoch>:<name>``, the
    name being the synthetic index or a build's ``<key>[#<window>]``."""
    return f"{epoch}:{name}"


class ItemSource(Protocol):
    """What the stream reads: items (documents) sized without building them, built on demand."""

    @property
    def num_items(self) -> int: ...
    def token_counts(self, indices: np.ndarray) -> np.ndarray: ...
    def name(self, index: int) -> str: ...
    def sample(self, index: int) -> TokenizedSample:
        """The item's tokens; raises SampleError for an item that cannot be built (skipped)."""
        ...


class SyntheticItems:
    """The generator's clips (source.py) as items."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self.clips = OmniSource(config)

    @property
    def num_items(self) -> int:
        return self.config.num_samples

    def token_counts(self, indices: np.ndarray) -> np.ndarray:
        return self.clips.token_counts(indices)

    def name(self, index: int) -> str:
        return str(index)

    def sample(self, index: int) -> TokenizedSample:
        return tokenize(self.clips.clip(index), self.config)


def make_source(config: DataConfig) -> ItemSource:
    if config.source == "shards":
        from resilient.trainer.data.shard_source import ShardSource  # deferred: media libraries

        return ShardSource(config)
    return SyntheticItems(config)


class RowStream:
    """Rows and global batches addressed by RowKey; holds no cursor (see OmniPipeline)."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self.source = make_source(config)
        self._token_counts: np.ndarray | None = None
        self._plans: OrderedDict[int, EpochPlan] = OrderedDict()

    def plan(self, epoch: int) -> EpochPlan:
        """The packing of one epoch (computed once per process, O(num_samples))."""
        if epoch in self._plans:
            self._plans.move_to_end(epoch)
            return self._plans[epoch]
        cfg = self.config
        plan = plan_epoch(
            self.token_counts(),
            seed=cfg.seed,
            epoch=epoch,
            row_len=cfg.row_len,
            packing_window=cfg.packing_window,
        )
        self._plans[epoch] = plan
        if len(self._plans) > _CACHED_PLANS:
            self._plans.popitem(last=False)
        return plan

    def token_counts(self) -> np.ndarray:
        """Tokens of every item (computed once per process, no item is built)."""
        if self._token_counts is None:
            self._token_counts = self.source.token_counts(np.arange(self.source.num_items))
        return self._token_counts

    def longest_item(self) -> int:
        """Tokens of the longest item: more than row_len means truncation."""
        if isinstance(self.source, SyntheticItems):  # known without sizing every item
            return self.config.max_sample_tokens
        return int(self.token_counts().max(initial=0))

    def rows_in_epoch(self, epoch: int) -> int:
        return self.plan(epoch).num_rows

    def advance(self, key: RowKey, rows: int) -> RowKey:
        """The address ``rows`` rows after key, crossing epoch ends as needed."""
        epoch, row = key.epoch, key.row + rows
        while row >= (in_epoch := self.rows_in_epoch(epoch)):
            row -= in_epoch
            epoch += 1
        return RowKey(epoch, row)

    def rows_for_step(self, cursor: RowKey, share: int, num_shares: int) -> list[RowKey]:
        """The rows of share ``share`` of the global batch that starts at ``cursor``.

        The global batch is the ``global_rows`` rows from cursor on, split into ``num_shares``
        equal contiguous shares; share s holds rows [s * k, (s + 1) * k) with k = global_rows /
        num_shares. Data-parallel rank r of W uses share=r, num_shares=W, so the union over ranks
        is the same global batch for every W that divides global_rows.
        """
        global_rows = self.config.global_rows
        if num_shares < 1 or global_rows % num_shares:
            divisors = [d for d in range(1, global_rows + 1) if global_rows % d == 0]
            raise ConfigError(
                f"num_shares={num_shares} does not divide DataConfig.global_rows={global_rows}: "
                f"use a data-parallel size in {divisors} or change global_rows"
            )
        if not 0 <= share < num_shares:
            raise ConfigError(f"share={share} is out of range: allowed [0, {num_shares - 1}]")
        per_share = global_rows // num_shares
        first = self.advance(cursor, share * per_share)
        return [self.advance(first, i) for i in range(per_share)]

    def batch(self, keys: list[RowKey]) -> Batch:
        """The rows at keys as one batch (B = len(keys), L = row_len); tensors share numpy memory."""
        cfg = self.config
        shape = (len(keys), cfg.row_len)
        arrays = {
            "text_tokens": np.zeros(shape, dtype=np.int64),
            "audio_frames": np.zeros((*shape, cfg.audio_dim), dtype=np.float32),
            "video_patches": np.zeros((*shape, cfg.video_dim), dtype=np.float32),
            "modality": np.full(shape, PAD, dtype=np.int64),
            "positions": np.zeros(shape, dtype=np.int64),
            "doc_ids": np.full(shape, -1, dtype=np.int64),
        }
        sample_ids, skipped = [], []
        read_ahead = getattr(self.source, "read_ahead", None)
        if read_ahead is not None:  # a shard source: fetch the batch's media at once
            read_ahead([int(i) for key in keys for i in self.plan(key.epoch).row_samples(key.row)])
        for b, key in enumerate(keys):
            indices = self.plan(key.epoch).row_samples(key.row)
            names = [sample_id(key.epoch, self.source.name(int(index))) for index in indices]
            failed = self._fill_row({name: array[b] for name, array in arrays.items()}, indices)
            sample_ids.append(names)
            skipped += [{"sample_id": names[doc], "reason": reason} for doc, reason in failed]
        batch: Batch = {name: torch.from_numpy(array) for name, array in arrays.items()}
        batch["sample_ids"] = sample_ids
        batch["skipped"] = skipped
        return batch

    def _fill_row(self, row: dict[str, np.ndarray], indices: np.ndarray) -> list[tuple[int, str]]:
        """Writes the row's documents; returns (doc, reason) of those that could not be built.
        Their slot stays padding: the documents after them move up, the plan stays the same."""
        from resilient.trainer.data.shard_source import SampleError

        offset, failed = 0, []
        for doc, index in enumerate(indices):
            try:
                sample = self.source.sample(int(index))
            except SampleError as e:
                failed.append((doc, str(e)))
                continue
            # Truncation: only a sample longer than the whole row can overflow (packing.py).
            kept = min(len(sample), self.config.row_len - offset)
            _write_document(row, sample, offset, kept, doc)
            offset += kept
        return failed


def _write_document(row: dict[str, np.ndarray], sample: TokenizedSample, offset: int, kept: int, doc: int) -> None:
    span = slice(offset, offset + kept)
    row["modality"][span] = sample.modality[:kept]
    row["positions"][span] = sample.positions[:kept]
    row["text_tokens"][span] = sample.text_tokens[:kept]
    row["doc_ids"][span] = doc
    audio = sample.audio_slots < kept
    row["audio_frames"][offset + sample.audio_slots[audio]] = sample.audio_frames[audio]
    video = sample.video_slots < kept
    row["video_patches"][offset + sample.video_slots[video]] = sample.video_patches[video]


def batch_token_fill(batch: Batch) -> float:
    """Fraction of the batch's token slots holding a token rather than padding."""
    return float((batch["modality"] != PAD).float().mean())
