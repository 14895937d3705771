"""``resilient-data``: turn a folder (or JSON-lines manifest) of real media into training shards.

    resilient-data build SRC --out DEST [--shard-size 256MiB] [--workers N] [--vocab-size 512] [--debug]

SRC: a folder whose files sharing a stem make one sample (video .mp4/.mkv/.webm, audio
.wav/.flac/.mp3/.m4a/.ogg, caption .txt or .json), or a .jsonl manifest of
``{"id", "video", "audio", "text", "segments"}`` with paths relative to it. DEST: a new local
folder or s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL). The format is docs/shards.md.
A file that does not decode is skipped and listed in DEST/skipped.jsonl; the build goes on.
Exit codes: 0 built (even with skips); 2 a usage, input or access error, one line on stderr.
Thin by design: the logic lives in resilient.trainer.data.shards.
"""

from __future__ import annotations

import argparse
import os
import sys

from resilient.errors import ResilientError
from resilient.tools.ckpt_output import parse_size
from resilient.tools.cli import OneLineParser, run_command

PROG = "resilient-data"


def _size(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def cmd_build(args: argparse.Namespace) -> int:
    from resilient.trainer.data.shards.build import BuildConfig, build

    config = BuildConfig(
        src=args.src,
        dest=args.out,
        shard_size=args.shard_size,
        workers=args.workers,
        vocab_size=args.vocab_size,
        max_duration_s=args.max_duration,
        progress=sys.stderr.isatty(),
    )
    summary = build(config)
    print(f"{PROG}: {summary.line()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Build WebDataset media shards (tars + per-shard index + tokenizer) for the trainer.",
        epilog="exit codes: 0 ok (skipped inputs are listed in DEST/skipped.jsonl), 1 a full disk, 2 usage, input "
        "or access error, 141 the reader of its output went away (| head)",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("build", help="probe, tokenize and shard a media folder or manifest")
    p.add_argument("src", metavar="SRC", help="folder of media + captions, or a .jsonl manifest")
    p.add_argument("--out", required=True, metavar="DEST", help="new local folder or s3://bucket/prefix")
    p.add_argument(
        "--shard-size", type=_size, default=256 << 20, metavar="SIZE", help="target tar size (default 256MiB)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        metavar="N",
        help="probing threads (default: CPU count, at most 8)",
    )
    p.add_argument(
        "--max-duration", type=float, default=600.0, metavar="S", help="skip samples longer than S seconds (600)"
    )
    p.add_argument("--vocab-size", type=int, default=512, metavar="N", help="BPE vocabulary incl. <pad> (default 512)")
    # SUPPRESS: the subcommand's default must not overwrite a --debug given before it.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return int(e.code or 0)
    return run_command(PROG, lambda: args.handler(args), debug=args.debug, expected=(ResilientError, OSError))


if __name__ == "__main__":
    sys.exit(main())
