"""OmniPipeline: the trainer's view of the data: a cursor, its batches, and its state.

Typical loop on data-parallel rank r of W::

    pipe = OmniPipeline(config, share=r, num_shares=W)
    pipe.load_state_dict(state["data"])          # on resume
    while training:
        batch = pipe.next_batch()                # this share's rows of the current global batch
        if train_step(batch):                    # committed (e.g. torchft should_commit())
            pipe.commit_step()                   # only now does the cursor move
        state["data"] = pipe.state_dict()

A step that is not committed is retried with the same batch: prefetching never moves the cursor.
"""

from __future__ import annotations

import logging
from typing import Any

from resilient.errors import ConfigError
from resilient.faults import fault_point
from resilient.trainer.data.config import DataConfig
from resilient.trainer.data.loader import PrefetchLoader
from resilient.trainer.data.state import check_state, fingerprint, make_state
from resilient.trainer.data.stream import Batch, RowKey, RowStream, sample_id

logger = logging.getLogger(__name__)


class OmniPipeline:
    """Batches of packed omni rows for one share of each global batch, resumable from a JSON state."""

    def __init__(self, config: DataConfig, *, share: int = 0, num_shares: int = 1) -> None:
        if num_shares < 1 or config.global_rows % num_shares or not 0 <= share < num_shares:
            raise ConfigError(
                f"share={share} of num_shares={num_shares} is invalid for DataConfig.global_rows="
                f"{config.global_rows}: num_shares must divide global_rows and 0 <= share < num_shares"
            )
        self.config = config
        self.share = share
        self.num_shares = num_shares
        self._stream = RowStream(config)
        self._cursor = RowKey(0, 0)
        self._loader = PrefetchLoader(self._stream, share, num_shares)
        longest = self._stream.longest_item()
        if longest > config.row_len:
            logger.warning(
                "[share %d] samples of up to %d tokens exceed row_len=%d and will be truncated",
                share,
                longest,
                config.row_len,
                extra={"event": "data_truncation", "row_len": config.row_len},
            )

    # Sizes the trainer needs to build the model.
    @property
    def audio_dim(self) -> int:
        return self.config.audio_dim

    @property
    def video_dim(self) -> int:
        return self.config.video_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    @property
    def rows_per_share(self) -> int:
        """B of this pipeline's batches."""
        return self.config.global_rows // self.num_shares

    @property
    def cursor(self) -> RowKey:
        """Address of the first row of the next global batch (the first row not yet committed)."""
        return self._cursor

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.config)

    def rows_for_step(self, cursor: RowKey, share: int, num_shares: int) -> list[RowKey]:
        """Rows of share ``share`` of ``num_shares`` of the global batch starting at ``cursor``."""
        return self._stream.rows_for_step(cursor, share, num_shares)

    def rows_in_epoch(self, epoch: int) -> int:
        return self._stream.rows_in_epoch(epoch)

    def token_fill(self, epoch: int | None = None) -> float:
        """Fraction of non-padding tokens over a whole epoch's rows (default: the cursor's epoch)."""
        return self._stream.plan(self._cursor.epoch if epoch is None else epoch).token_fill

    def batch_for_step(self, cursor: RowKey, share: int, num_shares: int) -> Batch:
        """Any share of any step's batch, built synchronously (tests, tools, debugging)."""
        return self._stream.batch(self._stream.rows_for_step(cursor, share, num_shares))

    def sample_ids_for_step(self, cursor: RowKey) -> list[str]:
        """Ids of every sample in the whole global batch at ``cursor`` (no tensors are built): what a
        replica group logs for a step whatever share of it the group trained."""
        keys = self._stream.rows_for_step(cursor, 0, 1)
        source, plan = self._stream.source, self._stream.plan
        return [sample_id(key.epoch, source.name(int(i))) for key in keys for i in plan(key.epoch).row_samples(key.row)]

    def next_batch(self) -> Batch:
        """This share's batch of the step at the cursor; the same batch until commit_step()."""
        fault_point("data.next_batch")  # tests make one rank's loader slow here
        return self._loader.batch_at(self._cursor)

    def commit_step(self) -> None:
        """Mark the current global batch consumed: call once the trainer has committed the step."""
        self._cursor = self._stream.advance(self._cursor, self.config.global_rows)

    def state_dict(self) -> dict[str, Any]:
        """{version, fingerprint, seed, epoch, rows_consumed}: plain JSON values."""
        return make_state(self.config, self._cursor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved cursor; raises RestoreError if the state is of another stream.

        Works for any num_shares dividing global_rows: the cursor counts global rows, not steps.
        """
        stored = check_state(self.config, state)
        # Normalize: a hand-edited state may point past its epoch's end.
        self._cursor = self._stream.advance(stored, 0)
        logger.info(
            "[share %d] data state restored at epoch %d row %d",
            self.share,
            self._cursor.epoch,
            self._cursor.row,
            extra={"event": "data_restored", "epoch": self._cursor.epoch, "rows_consumed": self._cursor.row},
        )

    def close(self) -> None:
        """Stop the loader's worker processes."""
        self._loader.close()

    def __enter__(self) -> OmniPipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
