"""resilient.trainer.data: the omni (audio + video + text) data pipeline.

A deterministic synthetic source (source.py), tokenized on one time axis after Qwen2.5-Omni's
TMRoPE (tokens.py), packed into fixed-length rows (packing.py), addressed row by row (stream.py),
prefetched by a DataLoader (loader.py) and driven by a committed-step cursor whose JSON state
resumes on any data-parallel size (pipeline.py, state.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resilient.lazy import lazy_exports

if TYPE_CHECKING:
    from resilient.trainer.data.config import DataConfig
    from resilient.trainer.data.pipeline import OmniPipeline
    from resilient.trainer.data.source import Clip, ClipParams, OmniSource
    from resilient.trainer.data.state import DATA_STATE_VERSION, fingerprint
    from resilient.trainer.data.stream import Batch, RowKey, RowStream, batch_token_fill, sample_id
    from resilient.trainer.data.tokens import AUDIO, PAD, TEXT, VIDEO, TokenizedSample, tokenize

# Imported on first use: the launcher reads `config` without importing torch (resilient.lazy).
__getattr__ = lazy_exports(
    __name__,
    {
        "DataConfig": "resilient.trainer.data.config",
        "OmniPipeline": "resilient.trainer.data.pipeline",
        "Clip": "resilient.trainer.data.source",
        "ClipParams": "resilient.trainer.data.source",
        "OmniSource": "resilient.trainer.data.source",
        "DATA_STATE_VERSION": "resilient.trainer.data.state",
        "fingerprint": "resilient.trainer.data.state",
        "Batch": "resilient.trainer.data.stream",
        "RowKey": "resilient.trainer.data.stream",
        "RowStream": "resilient.trainer.data.stream",
        "batch_token_fill": "resilient.trainer.data.stream",
        "sample_id": "resilient.trainer.data.stream",
        "AUDIO": "resilient.trainer.data.tokens",
        "PAD": "resilient.trainer.data.tokens",
        "TEXT": "resilient.trainer.data.tokens",
        "VIDEO": "resilient.trainer.data.tokens",
        "TokenizedSample": "resilient.trainer.data.tokens",
        "tokenize": "resilient.trainer.data.tokens",
    },
)

__all__ = [
    "AUDIO",
    "DATA_STATE_VERSION",
    "PAD",
    "TEXT",
    "VIDEO",
    "Batch",
    "Clip",
    "ClipParams",
    "DataConfig",
    "OmniPipeline",
    "OmniSource",
    "RowKey",
    "RowStream",
    "TokenizedSample",
    "batch_token_fill",
    "fingerprint",
    "sample_id",
    "tokenize",
]
