"""Counter-based randomness: a value is a pure function of its keys.

numpy's ``Generator`` streams may change between numpy releases, and drawing sample i would need
the draws of samples 0..i-1. A splitmix64 hash of (seed, stream, index) has neither problem: any
sample, on any worker, in any order, after any resume, gets the same values, vectorized over
arrays of indices.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # Arrays (never numpy scalars) wrap modulo 2**64 silently, which is what the hash wants.
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def hash64(*keys: int | np.ndarray) -> np.ndarray:
    """A uint64 array hashing the keys (non-negative ints or int arrays, broadcast together)."""
    state = np.zeros(1, dtype=np.uint64)
    for key in keys:
        state = _splitmix64(state ^ np.atleast_1d(np.asarray(key)).astype(np.uint64))
    return state


def uniform(*keys: int | np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from the top 53 bits of hash64(keys)."""
    return (hash64(*keys) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def integers(low: int, high: int, *keys: int | np.ndarray) -> np.ndarray:
    """Ints in [low, high] (inclusive), uniform up to float rounding (spans far below 2**53)."""
    return low + (uniform(*keys) * (high - low + 1)).astype(np.int64)
