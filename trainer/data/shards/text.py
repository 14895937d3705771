"""A sample's text in the contract's normalized form, the byte-level BPE trained on the corpus,
and the token counts the shard index carries.

Normalized text: ``{"text": str, "segments": [{"start": s, "end": s, "text": str}]}`` with
``text`` the untimed text ("" if none) and ``segments`` sorted by start ([] if none).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

PAD = "<pad>"
"""Id 0: the trainer pads rows with it."""
MIN_VOCAB_SIZE = 257
"""The 256 byte symbols of a byte-level BPE plus <pad>."""
MAX_VOCAB_SIZE = 1 << 20


class TextError(ValueError):
    """A caption file or manifest text that does not have the expected shape."""


def empty_text() -> dict:
    return {"text": "", "segments": []}


def read_text_file(path: str) -> dict:
    """``.txt`` (untimed text) or ``.json`` (``{"text", "segments"}``), normalized."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TextError(f"unreadable text: {e}") from e
    if path.lower().endswith(".txt"):
        return normalize(raw, [])
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise TextError(f"not JSON: {e}") from e
    except RecursionError as e:  # nested deeper than the parser's stack: no caption is that deep
        raise TextError("not a caption: JSON nested too deeply to parse") from e
    if not isinstance(data, dict):
        raise TextError('expected a JSON object {"text": ..., "segments": [...]}')
    return normalize(data.get("text") or "", data.get("segments") or [])


def normalize(text: object, segments: object) -> dict:
    """Checked, stripped, and segments sorted by (start, end) so equal input gives equal bytes."""
    if not isinstance(text, str):
        raise TextError(f'"text" must be a string, got {type(text).__name__}')
    if not isinstance(segments, list):
        raise TextError(f'"segments" must be a list, got {type(segments).__name__}')
    out = [_segment(i, s) for i, s in enumerate(segments)]
    out.sort(key=lambda s: (s["start"], s["end"]))
    return {"text": text.strip(), "segments": out}


def _segment(i: int, seg: object) -> dict:
    if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
        raise TextError(f'segment {i}: expected {{"start": s, "end": s, "text": str}}')
    try:
        start, end = float(seg["start"]), float(seg["end"])
    except (KeyError, TypeError, ValueError) as e:
        raise TextError(f"segment {i}: start and end must be numbers (seconds)") from e
    if not 0.0 <= start <= end:
        raise TextError(f"segment {i}: needs 0 <= start <= end, got [{start}, {end}]")
    return {"start": start, "end": end, "text": seg["text"].strip()}


def text_bytes(normalized: dict) -> bytes:
    """The stored ``<key>.json`` member: canonical (sorted keys, no spaces), UTF-8."""
    return json.dumps(normalized, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def all_strings(normalized: dict) -> list[str]:
    """Every piece of text the tokenizer should see, in order."""
    return [s for s in (normalized["text"], *(seg["text"] for seg in normalized["segments"])) if s]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE (GPT-2 style): any UTF-8 text encodes, no unknown token, <pad> is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen in the corpus or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_counts(tokenizer: tokenizers.Tokenizer, normalized: dict) -> dict:
    """``{"lead_tokens": n, "segments": [[start, end, n], ...]}`` as the shard index stores it."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids) if text else 0

    return {
        "lead_tokens": count(normalized["text"]),
        "segments": [[s["start"], s["end"], count(s["text"])] for s in normalized["segments"]],
    }
