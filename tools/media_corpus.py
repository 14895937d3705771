"""Write a small REAL media corpus (encoded files, as a crawl would give) from the synthetic source.

    python -m resilient.tools.media_corpus OUT [--clips N] [--seed S]

Clip i of ``OmniSource`` becomes, by i mod 4: an mp4 with H.264 video and AAC audio; an mp4 with
MPEG-4 Part 2 video and no audio; a FLAC file; a WAV file (its stem holds a dot, which the shard
build turns into ``_``). Captions alternate between ``.txt`` (untimed) and ``.json`` with one
timed segment per second. The last clip is written as a truncated mp4, exactly one corrupt file,
so a build has something to skip. Frames are upscaled 16 -> 64 px (nearest neighbour) because
H.264 wants at least a macroblock or two; video is encoded at the source's own fps.
"""

from __future__ import annotations

import json
import os
import sys
from fractions import Fraction

import numpy as np

from resilient.tools.cli import OneLineParser

SAMPLE_RATE = 16_000
UPSCALE = 4
"""16 x 16 source frames -> 64 x 64 encoded."""
KINDS = ("mp4_h264_aac", "mp4_mpeg4_silent", "flac", "wav")


def _source(seed: int):
    from resilient.trainer.data import DataConfig, OmniSource

    config = DataConfig(seed=seed, min_clip_seconds=1.0, max_clip_seconds=4.0, num_workers=0)
    return OmniSource(config), config


def _frames_u8(video: np.ndarray) -> np.ndarray:
    big = video.repeat(UPSCALE, axis=1).repeat(UPSCALE, axis=2)
    return np.clip(np.rint(big * 255.0), 0, 255).astype(np.uint8)


def _write_mp4(path: str, clip, fps: int, codec: str, with_audio: bool) -> None:
    import av

    frames = _frames_u8(clip.video)
    with av.open(path, "w", format="mp4") as out:
        video = out.add_stream(codec, rate=fps)
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if codec == "libx264":
            video.options = {"preset": "ultrafast"}
        audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono") if with_audio else None
        for j, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = j, Fraction(1, fps)
            out.mux(video.encode(frame))
        out.mux(video.encode())
        if audio is not None:
            samples = av.AudioFrame.from_ndarray(clip.audio[None, :], format="flt", layout="mono")
            samples.sample_rate, samples.pts = SAMPLE_RATE, 0
            out.mux(audio.encode(samples))
            out.mux(audio.encode())


def _caption(path_stem: str, clip, timed: bool) -> str:
    words = clip.caption
    if not timed:
        path = path_stem + ".txt"
        with open(path, "w", encoding="utf-8") as f:
            f.write(" ".join(words) + "\n")
        return path
    seconds = max(1, int(np.ceil(clip.params.seconds)))
    per = int(np.ceil(len(words) / seconds))
    segments = [
        {
            "start": float(k),
            "end": float(min(k + 1, clip.params.seconds)),
            "text": " ".join(words[k * per : (k + 1) * per]),
        }
        for k in range(seconds)
        if words[k * per : (k + 1) * per]
    ]
    path = path_stem + ".json"
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"text": "", "segments": segments}, f)
    return path


def _write_clip(out_dir: str, index: int, clip, fps: int) -> list[str]:
    import soundfile

    kind = KINDS[index % len(KINDS)]
    stem = os.path.join(out_dir, f"clip{index:02d}" + (".take1" if kind == "wav" else ""))
    if kind == "mp4_h264_aac":
        media = stem + ".mp4"
        _write_mp4(media, clip, fps, "libx264", with_audio=True)
    elif kind == "mp4_mpeg4_silent":
        media = stem + ".mp4"
        _write_mp4(media, clip, fps, "mpeg4", with_audio=False)
    else:
        media = f"{stem}.{kind}"
        soundfile.write(media, clip.audio, SAMPLE_RATE, subtype="PCM_16")
    return [media, _caption(stem, clip, timed=index % 2 == 1)]


def _write_corrupt(out_dir: str, index: int, clip, fps: int) -> list[str]:
    """A download cut at 40%: mp4's index (moov) is written last, so what remains does not open."""
    path = os.path.join(out_dir, f"clip{index:02d}.mp4")
    _write_mp4(path, clip, fps, "libx264", with_audio=True)
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * 0.4))
    return [path, _caption(path[: -len(".mp4")], clip, timed=False)]


def write_corpus(out_dir: str, clips: int = 12, seed: int = 0) -> list[str]:
    """Write ``clips`` samples (the last one corrupt) under ``out_dir``; the paths written, sorted."""
    if clips < 2:
        raise ValueError(f"clips must be >= 2 (one good clip and the corrupt one), got {clips}")
    os.makedirs(out_dir, exist_ok=True)
    source, config = _source(seed)
    written: list[str] = []
    for index in range(clips):
        write = _write_corrupt if index == clips - 1 else _write_clip
        written += write(out_dir, index, source.clip(index), config.video_fps)
    return sorted(written)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m resilient.tools.media_corpus", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder to write the corpus into (created)")
    parser.add_argument("--clips", type=int, default=12, help="samples to write, the last one corrupt (>= 2)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic source seed")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.clips < 2:
        parser.error(f"--clips must be >= 2, got {args.clips}")
    paths = write_corpus(args.out, args.clips, args.seed)
    print(f"wrote {len(paths)} files for {args.clips} clips (1 corrupt) under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
