"""One stream of an FFmpeg container, as both media decoders read it: the error every decoder
raises, the packets of a stream under a bound, where the file's timeline starts, how long its
header says the stream is, and whether the decode reached that length.

``media_audio`` and ``media_video`` build on these; ``media`` is the face the loader calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from fractions import Fraction

import av

from resilient.errors import ResilientError

# A bound on the decode loops whatever the demuxer believes: no real file in a shard packs more
# packets than bytes, so a broken file that keeps yielding is stopped instead of spinning.
MIN_PACKET_BUDGET = 10_000
# How much shorter than declared a decoded stream may end before it counts as truncated.
TRUNCATION_SLACK_S = 0.1


class MediaError(ResilientError):
    """A media file that does not decode: corrupt or truncated bytes, no stream of the kind asked
    for, or an extension no decoder here handles. The message names the extension and the reason."""


def packet_budget(data: bytes) -> int:
    """How many packets a file of these bytes may yield (see MIN_PACKET_BUDGET)."""
    return max(MIN_PACKET_BUDGET, len(data))


def only_stream(container: av.container.InputContainer, stream: av.stream.Stream) -> None:
    """Tells the demuxer to drop every other stream's packets as it reads them: an mp4's video
    packets are then never copied out to be thrown away when only its soundtrack is wanted."""
    for other in container.streams:
        if other.index != stream.index:
            other.discard = av.stream.Discard.all


def packets(container: av.container.InputContainer, stream: av.stream.Stream, budget: int) -> Iterator[av.Packet]:
    """Packets of one stream, at most ``budget`` of them, then the empty packet that flushes the
    decoder's delayed frames."""
    for count, packet in enumerate(container.demux(stream)):
        if count >= budget:
            raise _endless(budget)
        yield packet


def bounded_packets(
    container: av.container.InputContainer, stream: av.stream.Stream, budget: int
) -> tuple[Iterator[av.Packet], Callable[[], None]]:
    """``packets`` without a Python frame per packet (a 21 ms AAC frame is one packet): the first
    ``budget`` packets, and a check to call once they have run out, which raises as ``packets``
    does where the stream had more."""
    demuxed = container.demux(stream)

    def check_ended() -> None:
        if next(demuxed, None) is not None:
            raise _endless(budget)

    return itertools.islice(demuxed, budget), check_ended


def _endless(budget: int) -> MediaError:
    return MediaError(f"gave up after {budget} packets: the stream does not end")


def timeline_origin(container: av.container.InputContainer) -> float:
    """Seconds of the file's first presented instant, which becomes time 0. MP3 reports its first
    frame at the encoder+decoder delay (~25 ms) after skipping those samples; AAC in mp4 reports 0
    after its edit list trims the priming. Subtracting the container's start (not a stream's) keeps
    audio and video of one file on one clock, as ffmpeg does when it rebases timestamps."""
    return container.start_time / av.time_base if container.start_time is not None else 0.0


def declared_duration(container: av.container.InputContainer, stream: av.stream.Stream) -> float | None:
    """The stream's length as its header declares it (mp4 index, MP3 Xing frame count), or the
    container's when the stream is its only one (matroska keeps only the segment's). None when
    nothing trustworthy is declared: a container's length with several streams is the longest
    one's, and audio may legitimately end before the video."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration and len(container.streams) == 1:
        return container.duration / av.time_base
    return None


def check_complete(ext: str, declared_s: float | None, decoded_s: float, kind: str = "audio") -> None:
    """A file cut short (a partial download) often still demuxes: the packets just stop. Decoding
    to its end and finding less than the header declared says so. Slack: codec frame padding and
    bitrate-estimated MP3 lengths are off by a little, a truncation by much more."""
    if declared_s is not None and decoded_s < declared_s - max(TRUNCATION_SLACK_S, 0.02 * declared_s):
        raise MediaError(
            f"cannot decode {kind} from .{ext}: truncated, the header declares {declared_s:.3f} s, "
            f"the stream ends at {decoded_s:.3f} s"
        )


def seek_pts(seconds: float, time_base: Fraction | None) -> int:
    """``seconds`` as a timestamp in ``time_base`` units, for ``container.seek``."""
    if not time_base:
        raise MediaError("the stream has no time base to seek by")
    return int(Fraction(seconds).limit_denominator(1_000_000) / time_base)
