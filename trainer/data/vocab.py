"""The caption vocabulary of the synthetic omni source.

A fixed word list, so token ids never depend on data seen: id 0 is padding, and a caption always
has the same number of words (the packer can size a sample without rendering it).
"""

from __future__ import annotations

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.2),
    "blue": (0.2, 0.3, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "cyan": (0.1, 0.9, 0.9),
    "magenta": (0.9, 0.1, 0.9),
    "white": (1.0, 1.0, 1.0),
    "orange": (1.0, 0.5, 0.0),
}
SIZES: dict[str, int] = {"small": 2, "big": 4}
"""Object side in pixels, by caption word (integer sides keep the rendered centroid exact)."""
TEMPOS: dict[str, float] = {"slow": 1.0, "steady": 2.0, "fast": 4.0}
"""Beats (note onsets) per second, by caption word."""
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
MANY = "many"

PROMPT_WORDS = (BOS, "describe", "this", "clip")
"""Text before the media."""
_CAPTION_TEMPLATE = (
    "a",
    "{size}",
    "{color}",
    "square",
    "moves",
    "{direction}",
    "with",
    "a",
    "{pitch}",
    "{tempo}",
    "tone",
    "for",
    "{seconds}",
    "seconds",
    EOS,
)

VOCAB: tuple[str, ...] = tuple(
    dict.fromkeys(
        [PAD, BOS, EOS, *PROMPT_WORDS]
        + [w for w in _CAPTION_TEMPLATE if not w.startswith("{")]
        + ["left", "right", "rising", "falling", *SIZES, *COLORS, *TEMPOS, *NUMBERS, MANY]
    )
)
"""Every word, in id order (dict.fromkeys keeps first occurrences, so ids are stable)."""
WORD_IDS: dict[str, int] = {word: i for i, word in enumerate(VOCAB)}
TEXT_TOKENS_PER_SAMPLE = len(PROMPT_WORDS) + len(_CAPTION_TEMPLATE)


def seconds_word(seconds: float) -> str:
    """The number word for a clip length, rounded to whole seconds ('many' past ten)."""
    whole = round(seconds)
    return NUMBERS[whole] if whole < len(NUMBERS) else MANY


def caption_words(*, size: str, color: str, rising: bool, tempo: str, seconds: float) -> list[str]:
    """The caption after the media: what moves, which way, and how the tone sounds."""
    fill = {
        "{size}": size,
        "{color}": color,
        # The object's x follows the pitch, so a rising tone moves it right.
        "{direction}": "right" if rising else "left",
        "{pitch}": "rising" if rising else "falling",
        "{tempo}": tempo,
        "{seconds}": seconds_word(seconds),
    }
    return [fill.get(word, word) for word in _CAPTION_TEMPLATE]


def encode(words: list[str] | tuple[str, ...]) -> list[int]:
    """Token ids of words (every word is in VOCAB by construction)."""
    return [WORD_IDS[word] for word in words]
