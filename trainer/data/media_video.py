"""Video through FFmpeg for ``resilient.trainer.data.media.decode_video``: the frame on screen at
each sampled instant, resized once."""

from __future__ import annotations

import bisect
import io
import math
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from resilient.trainer.data.media_stream import (
    MediaError,
    check_complete,
    declared_duration,
    only_stream,
    packet_budget,
    packets,
    seek_pts,
    timeline_origin,
)

# A keyframe further ahead than this is reached by a seek rather than by reading every packet
# before it (a few frames' worth: a seek costs about what reading a handful of packets does).
_SEEK_AHEAD_S = 0.2


def decode_video_av(
    data: bytes, ext: str, fps: int, size: int, start_s: float, duration_s: float | None, threads: int
) -> np.ndarray:
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise MediaError(f"cannot decode video from .{ext}: the file has no video stream")
        stream = container.streams.video[0]
        only_stream(container, stream)
        # Frame threads decode several frames at once: a 2-4x speedup on long-GOP H.264 when cores
        # are free; the benchmark pins threads=1 to measure one core.
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = threads
        origin = timeline_origin(container)
        if start_s > 0:
            # Lands on the keyframe at or before start_s; the frames from there to start_s are
            # decoded (they are needed as references) but never resized.
            container.seek(seek_pts(start_s + origin, stream.time_base), stream=stream, backward=True)
        sampler = _FrameSampler(
            fps=fps, size=size, start_s=start_s, duration_s=duration_s, origin=origin, time_base=stream.time_base
        )
        frame_duration = _fallback_frame_duration(stream)
        keyframes = _Keyframes.listed(stream, origin, len(data))
        sought: int | None = None
        for packet in packets(container, stream, packet_budget(data)):
            jump = sampler.jump_to(packet, keyframes.times, stream.codec_context.has_b_frames)
            if jump is not None:
                # Far ahead, a seek to the keyframe (exact: to its own index timestamp) costs less
                # than reading the packets in between; never twice to one keyframe, so a demuxer
                # that lands short is read through instead of sought again.
                if keyframes.times[jump] - sampler.packet_time > _SEEK_AHEAD_S and keyframes.stamps[jump] != sought:
                    sought = keyframes.stamps[jump]
                    container.seek(sought, stream=stream, backward=True)
                continue
            # A frame no target shows is only decoded if later frames reference it: at fps=2 from a
            # 25 fps source most non-reference (B) frames are never shown, and skipping them is
            # exact. FFmpeg reads skip_frame per packet sent, so it can change packet by packet.
            shown = sampler.may_show(packet, frame_duration)
            stream.codec_context.skip_frame = "DEFAULT" if shown else "NONREF"
            decoded = packet.decode()
            sampler.in_flight += (1 if packet.size else 0) - len(decoded)
            if not all(sampler.offer(frame) for frame in decoded):
                break
        else:  # decoded to the end of the file: it must be as long as its header says
            stream_end = sampler.held_time + frame_duration if sampler.held is not None else 0.0
            check_complete(ext, declared_duration(container, stream), stream_end, kind="video")
        frames = sampler.finish(frame_duration)
    if not frames:
        return np.zeros((0, size, size, 3), dtype=np.float32)
    return np.stack(frames).astype(np.float32) / np.float32(255.0)


@dataclass(frozen=True, slots=True)
class _Keyframes:
    """The keyframes the container's index lists, ascending, as far as the bytes at hand reach (a
    cut file's index names keyframes that never arrive)."""

    times: list[float]
    """Seconds from the origin."""
    stamps: list[int]
    """The same, as index timestamps in the stream's time base (what a seek lands on exactly)."""

    @classmethod
    def listed(cls, stream: av.video.stream.VideoStream, origin: float, size: int) -> _Keyframes:
        if stream.time_base is None:
            return cls(times=[], stamps=[])
        numerator, denominator = stream.time_base.numerator, stream.time_base.denominator
        stamps = sorted(
            entry.timestamp for entry in stream.index_entries if entry.is_keyframe and entry.pos + entry.size <= size
        )
        return cls(times=[stamp * numerator / denominator - origin for stamp in stamps], stamps=stamps)


def _fallback_frame_duration(stream: av.video.stream.VideoStream) -> float:
    rate = stream.average_rate or stream.guessed_rate
    return float(1 / rate) if rate else 0.04


class _FrameSampler:
    """Picks, from frames arriving in display order, the one on screen at each target time
    start_s + j / fps: a frame is known to cover the targets before the NEXT frame's time, so each
    frame is held until its successor (or the end of the stream) arrives."""

    def __init__(
        self,
        *,
        fps: int,
        size: int,
        start_s: float,
        duration_s: float | None,
        origin: float,
        time_base: Fraction | None,
    ) -> None:
        self.fps, self.size, self.start_s, self.origin = fps, size, start_s, origin
        # The packets' time base as integers: one division per packet instead of Fraction arithmetic
        # (integer true division rounds once, exactly as float(Fraction(...)) does).
        self._tick = (time_base.numerator, time_base.denominator) if time_base else None
        self.packet_time = 0.0  # seconds of the last packet jump_to looked at
        self.in_flight = 0  # packets sent to the decoder whose frames have not come out yet (frame threads)
        self._jumped = False  # packets were left out since the held frame: its successor is not its neighbour
        # Number of targets the requested window allows; the stream's end may cut it shorter.
        self.limit = None if duration_s is None else _count_before(duration_s * fps)
        self.frames: list[np.ndarray] = []
        self.held: av.VideoFrame | None = None
        self.held_time = 0.0
        self.frame_duration: float | None = None
        # One reformatter per step for the whole decode: each keeps its scaler between frames.
        # frame.reformat() builds a new one per call, and setting up a 40x AREA scaler costs far
        # more than running it.
        self._to_rgb, self._resize = VideoReformatter(), VideoReformatter()

    def _target(self, j: int) -> float:
        return self.start_s + j / self.fps

    def _done(self) -> bool:
        return self.limit is not None and len(self.frames) >= self.limit

    def jump_to(self, packet: av.Packet, keyframes: list[float], reordered_frames: int) -> int | None:
        """The keyframe (its index in ``keyframes``) decoding may restart at, leaving this packet
        out, or None to decode it. It may when frames
        come in display order (no B-frames, pts = dts) and a keyframe lies after this packet, at or
        before the first pending target, every pending target is shown by that keyframe or a frame
        after it, and none of those references this one. A codec without non-reference frames
        (MPEG-4 Part 2 without B-frames) then decodes a few frames per target instead of all."""
        if reordered_frames or not keyframes or packet.pts is None or packet.pts != packet.dts or not self._tick:
            return None
        time = self.packet_time = packet.pts * self._tick[0] / self._tick[1] - self.origin
        if self.in_flight == 0 and self.held is not None and time > self.held_time:
            # Frames come in display order and the decoder holds none back: the held frame is on
            # screen until this packet's frame, known now without decoding it.
            self._emit_until(time)
        after = bisect.bisect_right(keyframes, time + 1e-9)
        if after < len(keyframes) and not self._done() and keyframes[after] <= self._target(len(self.frames)) + 1e-9:
            self._jumped = True
            return after
        return None

    def may_show(self, packet: av.Packet, fallback_duration: float) -> bool:
        """Whether the frame in ``packet`` can be on screen at a pending target: the targets in
        [pts, pts + duration). Unknown timing answers yes (decoding a frame is never wrong)."""
        if packet.pts is None or self._tick is None:
            return True
        numerator, denominator = self._tick
        shown_from = packet.pts * numerator / denominator - self.origin
        duration = packet.duration * numerator / denominator if packet.duration else fallback_duration
        j = max(len(self.frames), _count_before((shown_from - self.start_s) * self.fps))
        if self.limit is not None and j >= self.limit:
            return False
        return self._target(j) < shown_from + duration + 1e-6

    def offer(self, frame: av.VideoFrame) -> bool:
        """Takes the next decoded frame; False once every target is filled."""
        time = self._time_of(frame)
        if self.held is not None:
            if time > self.held_time and not self._jumped:
                self.frame_duration = time - self.held_time
            self._emit_until(time)
        self.held, self.held_time, self._jumped = frame, time, False
        return not self._done()

    def _time_of(self, frame: av.VideoFrame) -> float:
        if frame.time is not None:
            return frame.time - self.origin
        # No timestamp (rare, broken muxers): assume it follows the previous frame at the stream's pace.
        return self.held_time + (self.frame_duration or 0.0)

    def finish(self, fallback_duration: float) -> list[np.ndarray]:
        """The last frame covers its own duration; targets past it are beyond the stream's end."""
        if self.held is not None and not self._done():
            duration = self.held.duration * self.held.time_base if self.held.duration and self.held.time_base else None
            duration = float(duration) if duration else (self.frame_duration or fallback_duration)
            self._emit_until(self.held_time + duration)
        return self.frames

    def _resized(self, frame: av.VideoFrame) -> np.ndarray:
        """[size, size, 3] uint8 RGB: the frame converted to RGB at its full size, then each output
        pixel the average of the source pixels in its area. AREA's box filter is the cheap correct
        choice for heavy downscaling (640x360 -> 16x16 is a 40x cut: bilinear would read 4 of ~900
        pixels per output and alias fine detail into noise). Converting first costs a full-size
        conversion per sampled frame; converting and scaling in one step is cheaper but lands
        several times further from the exact average (data_bench's mae_vs_full_res lines)."""
        planar = self._to_rgb.reformat(frame, format="gbrp")
        out = self._resize.reformat(planar, width=self.size, height=self.size, format="rgb24", interpolation="AREA")
        return out.to_ndarray()

    def _emit_until(self, next_time: float) -> None:
        """The held frame is on screen until ``next_time``: it fills every pending target before then
        (including targets before the first frame, which the first frame stands in for)."""
        rgb = None
        while not self._done() and self._target(len(self.frames)) < next_time - 1e-9:
            if rgb is None:
                rgb = self._resized(self.held)
            self.frames.append(rgb)


def _count_before(limit: float) -> int:
    """Number of integers j >= 0 with j < limit, with float slack (2.0000000001 targets from a
    duration of 1.0 s at 2 fps count as 2, not 3)."""
    return max(math.ceil(limit - 1e-9), 0)
