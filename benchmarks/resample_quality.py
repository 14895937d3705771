"""How much of a tone above the output's Nyquist frequency each resampler lets through (folded into
the band): libswresample through PyAV (the decoders' resampler before libsoxr) against libsoxr as the
decoders use it (``resilient.trainer.data.media_audio.resample``).

    .venv/bin/python benchmarks/resample_quality.py

The tones are the ones ``test_resampling_is_band_limited_and_within_tolerance_of_the_exact_signal``
checks: 1.06 and 1.5 x the output's Nyquist frequency and 0.95 x the input's, 2 s each, measured
20 ms in from the clip's ends. One JSON line per rate pair and tone: the level that comes out, in dB
of the tone that went in. Then one line per rate pair for the passband: the largest difference, 20
ms in from the ends, from the exact tones (0.1, 0.45 and 0.74 x the lower Nyquist frequency, summed)
sampled at the output rate, against the test's ``RESAMPLE_TOLERANCE``.
"""

from __future__ import annotations

import json
from fractions import Fraction

import av
import numpy as np

from resilient.trainer.data.media_audio import resample

PAIRS = [(48000, 16000), (44100, 16000), (22050, 16000), (48000, 8000)]
PASSBAND_PAIRS = [*PAIRS, (16000, 22050)]
SECONDS, EDGE_S, AMPLITUDE = 2.0, 0.02, 0.3


def swr(signal: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to_rate)
    frame = av.AudioFrame.from_ndarray(signal[None, :], format="flt", layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = from_rate, 0, Fraction(1, from_rate)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in resampler.resample(frame) + resampler.resample(None)])


def level_db(out: np.ndarray, to_rate: int) -> float:
    inner = out[round(EDGE_S * to_rate) : -round(EDGE_S * to_rate)]
    return round(float(20 * np.log10(np.sqrt(np.mean(inner.astype(np.float64) ** 2)) / (AMPLITUDE / np.sqrt(2)))), 1)


def tones(rate: int, freqs: list[float]) -> np.ndarray:
    t = np.arange(round(SECONDS * rate)) / rate
    return sum(AMPLITUDE * np.sin(2 * np.pi * f * t + i) for i, f in enumerate(freqs))


def passband_error(out: np.ndarray, exact: np.ndarray, to_rate: int) -> float:
    inner = slice(round(EDGE_S * to_rate), -round(EDGE_S * to_rate))
    return float(f"{np.abs(out[inner] - exact[inner]).max():.2g}")


def main() -> None:
    for from_rate, to_rate in PAIRS:
        for freq in (to_rate / 2 * 1.06, to_rate / 2 * 1.5, from_rate / 2 * 0.95):
            tone = tones(from_rate, [freq]).astype(np.float32)
            line = {"bench": "resample_quality", "from_hz": from_rate, "to_hz": to_rate, "tone_hz": round(freq)}
            line |= {"libswresample_db": level_db(swr(tone, from_rate, to_rate), to_rate)}
            line |= {"libsoxr_hq_db": level_db(resample(tone, from_rate, to_rate), to_rate), "unit": "dB"}
            print(json.dumps(line))
    for from_rate, to_rate in PASSBAND_PAIRS:
        freqs = [k * min(from_rate, to_rate) / 2 for k in (0.1, 0.45, 0.74)]
        signal, exact = tones(from_rate, freqs).astype(np.float32), tones(to_rate, freqs)
        line = {"bench": "resample_passband", "from_hz": from_rate, "to_hz": to_rate}
        line |= {"libswresample_max_abs": passband_error(swr(signal, from_rate, to_rate), exact, to_rate)}
        line |= {"libsoxr_hq_max_abs": passband_error(resample(signal, from_rate, to_rate), exact, to_rate)}
        print(json.dumps(line))


if __name__ == "__main__":
    main()
