"""resilient.trainer.data: the omni (audio + video + text) data pipeline.

A deterministic synthetic source (source.py), tokenized on one time axis after Qwen2.5-Omni's
TMRoPE (tokens.py), packed into fixed-length rows (packing.py), addressed row by row (stream.py),
prefetched by a DataLoader (loader.py) and driven by a committed-step cursor whose JSON state
resumes on any data-parallel size (pipeline.py, state.py).
"""

from __future__ import annotations

from resilient.trainer.data.config import DataConfig
from resilient.trainer.data.pipeline import OmniPipeline
from resilient.trainer.data.source import Clip, ClipParams, OmniSource
from resilient.trainer.data.state import DATA_STATE_VERSION, fingerprint
from resilient.trainer.data.stream import Batch, RowKey, RowStream, batch_token_fill, sample_id
from resilient.trainer.data.tokens import AUDIO, PAD, TEXT, VIDEO, TokenizedSample, tokenize

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
