"""Plain PCM WAV read straight from the bytes: the samples lie where the RIFF header says, so a
window is a slice of the buffer and one conversion to float32. The values are the ones libsndfile
returns for the same file (integers scaled by a power of two, which is exact in float32); anything
this does not know (compressed WAV, 8-bit, 64-bit float, RF64) is left to libsndfile."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resilient.trainer.data.media_stream import MediaError

_PCM, _IEEE_FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
# (format tag, bits per sample) -> numpy dtype of one sample in the file; 24-bit is assembled by hand.
_LAYOUTS = {(_PCM, 16): "<i2", (_PCM, 24): "u1", (_PCM, 32): "<i4", (_IEEE_FLOAT, 32): "<f4"}
# Sizes a WAV written to a pipe carries in its header: complete, but unsized.
_UNSIZED = (0, 0xFFFFFFFF)


@dataclass(frozen=True, slots=True)
class WavSamples:
    """Where a WAV's samples lie in its bytes and how to read them."""

    data: bytes
    rate: int
    channels: int
    dtype: str
    bytes_per_frame: int
    offset: int
    """Byte offset of the first sample."""
    length: int
    """Frames (one sample per channel) the file holds."""

    def frames(self, first: int, last: int) -> np.ndarray:
        """[frames, channels] float32 of frames [first, last), clipped to the file."""
        first, last = min(first, self.length), min(max(last, first), self.length)
        start = self.offset + first * self.bytes_per_frame
        if self.dtype == "u1":  # 24-bit: three bytes per sample, little-endian, placed in an int32's top bytes
            raw = np.frombuffer(self.data, np.uint8, (last - first) * self.bytes_per_frame, start).reshape(-1, 3)
            wide = raw.astype(np.int32) << np.array([8, 16, 24], dtype=np.int32)
            samples: np.ndarray = wide[:, 0] | wide[:, 1] | wide[:, 2]
        else:
            samples = np.frombuffer(self.data, self.dtype, (last - first) * self.channels, start)
        scale = np.float32({"<i2": 2.0**-15, "<f4": 1.0}.get(self.dtype, 2.0**-31))
        # One pass: each sample converted to float32, then scaled in float32 (a power of two: exact).
        # The result is a new array: it never aliases the caller's bytes.
        return np.multiply(samples, scale, dtype=np.float32).reshape(-1, self.channels)


def read_wav(data: bytes, ext: str) -> WavSamples | None:
    """The sample layout of a plain PCM or float WAV, None for any other kind of file. Raises
    MediaError for a WAV cut short: its header declares more audio than the bytes hold."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    fmt: tuple[int, int, int, int, int] | None = None
    position = 12
    while position + 8 <= len(data):
        chunk, size = data[position : position + 4], int.from_bytes(data[position + 4 : position + 8], "little")
        body = position + 8
        if chunk == b"fmt " and size >= 16:
            fmt = _format(data[body : body + size])
        elif chunk == b"data":
            return _samples(data, ext, fmt, body, size)
        position = body + size + (size & 1)  # chunks are padded to an even size
    return None


def _format(chunk: bytes) -> tuple[int, int, int, int, int]:
    """(format tag, channels, rate, block align, bits per sample); WAVE_FORMAT_EXTENSIBLE's real tag
    is the first two bytes of its sub-format GUID."""
    tag = int.from_bytes(chunk[0:2], "little")
    channels = int.from_bytes(chunk[2:4], "little")
    rate = int.from_bytes(chunk[4:8], "little")
    align = int.from_bytes(chunk[12:14], "little")
    bits = int.from_bytes(chunk[14:16], "little")
    if tag == _EXTENSIBLE and len(chunk) >= 26:
        tag = int.from_bytes(chunk[24:26], "little")
    return tag, channels, rate, align, bits


def _samples(
    data: bytes, ext: str, fmt: tuple[int, int, int, int, int] | None, offset: int, size: int
) -> WavSamples | None:
    if fmt is None:
        return None
    tag, channels, rate, align, bits = fmt
    dtype = _LAYOUTS.get((tag, bits))
    if dtype is None or channels < 1 or rate < 1 or align != channels * bits // 8:
        return None
    held = len(data) - offset
    if size not in _UNSIZED and held < size:
        raise MediaError(
            f"cannot decode audio from .{ext}: truncated, the header declares {size} bytes of audio, "
            f"the file holds {held}"
        )
    usable = held if size in _UNSIZED else size
    return WavSamples(
        data=data,
        rate=rate,
        channels=channels,
        dtype=dtype,
        bytes_per_frame=align,
        offset=offset,
        length=usable // align,
    )
