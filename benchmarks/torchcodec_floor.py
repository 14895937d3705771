"""torchcodec's time for data_bench's rows, run by data_bench under ANOTHER interpreter: torchcodec
is not a dependency of this project, so it lives in a scratch environment of its own (the command
that builds one is in benchmarks/README.md, "data_bench.py").

Reads one JSON request per line on stdin, decodes once, answers one JSON line on stdout:

    {"kind": "audio", "path": ..., "sample_rate": 16000, "wav": false}
        -> {"seconds": ...}                      mono float32 at sample_rate, the whole file
                                                 (with "wav": its WavDecoder, for a 16 kHz mono WAV)
    {"kind": "video", "path": ..., "fps": 2, "size": 16, "frames": 20, "save": PATH or null}
        -> {"seconds": ...}                      frames at j / fps, resized to size x size
    {"kind": "version"} -> {"torchcodec": ..., "torch": ...}

The time covers opening the decoder and decoding, as data_bench times its own calls; with "save"
the frames are written afterwards as float32 [F, size, size, 3] in [0, 1] (.npy) for the quality
comparison. One thread: torch and FFmpeg, as data_bench pins its own rows.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import torchcodec
from torchcodec.decoders import AudioDecoder, VideoDecoder, WavDecoder
from torchcodec.transforms import Resize

# The clock data_bench names as the argument: "cpu" (this process's CPU time) or "wall".
CLOCK = time.process_time if sys.argv[1:] != ["wall"] else time.perf_counter


def audio(request: dict) -> dict:
    with open(request["path"], "rb") as f:
        data = f.read()
    start = CLOCK()
    if request.get("wav"):  # its dedicated WAV decoder: no resampling or remixing, and none is needed
        WavDecoder(data).get_all_samples()
    else:
        AudioDecoder(data, sample_rate=request["sample_rate"], num_channels=1).get_all_samples()
    return {"seconds": CLOCK() - start}


def video(request: dict) -> dict:
    with open(request["path"], "rb") as f:
        data = f.read()
    size, fps = request["size"], request["fps"]
    start = CLOCK()
    decoder = VideoDecoder(data, dimension_order="NHWC", num_ffmpeg_threads=1, transforms=[Resize((size, size))])
    frames = decoder.get_frames_played_at([j / fps for j in range(request["frames"])]).data
    seconds = CLOCK() - start
    if request.get("save"):
        np.save(request["save"], frames.numpy().astype(np.float32) / np.float32(255.0))
    return {"seconds": seconds}


def main() -> None:
    torch.set_num_threads(1)
    for text in sys.stdin:
        request = json.loads(text)
        if request["kind"] == "version":
            answer = {"torchcodec": torchcodec.__version__, "torch": torch.__version__}
        else:
            answer = {"audio": audio, "video": video}[request["kind"]](request)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
