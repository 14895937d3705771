"""``resilient-ckpt``: look inside, verify, compare, convert, reshard and prune checkpoints.

    resilient-ckpt ls ROOT
    resilient-ckpt inspect URL [--step N] [--tensors GLOB]
    resilient-ckpt verify URL [--step N | --all]
    resilient-ckpt diff A B [--atol X]
    resilient-ckpt convert SRC DST --to {resilient,safetensors,torch,dcp} [--dtype bfloat16] [--tensors GLOB]
    resilient-ckpt reshard SRC DST --mesh dp_shard=8,tp=4 | --chunks GLOB=SHAPE ...
    resilient-ckpt prune ROOT --keep-last N [--dry-run]

URLs are local paths, file:///..., or s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL); a URL may
name a checkpoint root (its newest step) or one step directory. Exit codes: 0 ok; 1 a finding
(corruption, a difference, a damaged manifest); 2 a usage, access or machine error (a full disk),
one line on stderr; 141 when the reader of its output went away (``| head``), as for SIGPIPE.
A damaged step is a finding, never the end of the command: ``ls`` and ``verify --all`` report it
and go on to the other steps (``--json``: each step's ``status`` is "ok" or "damaged"), and
``inspect ROOT`` shows the newest step that reads, naming the newer damaged ones (exit 1).
Thin by design: all logic lives in resilient.storage.offline (catalog, verify, diff, convert, reshard, prune).
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback

from resilient.errors import IntegrityError, ResilientError
from resilient.tools import ckpt_output as out
from resilient.tools.cli import OneLineParser, call_or_stdout_closed

PROG = "resilient-ckpt"


def _size(text: str) -> int:
    try:
        return out.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tolerance(text: str) -> float:
    try:
        atol = float(text)
    except ValueError:
        atol = math.nan
    if not atol >= 0 or math.isinf(atol):  # NaN fails every comparison: no pair would be "equal"
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, e.g. 1e-6, got {text!r}")
    return atol


def _quiet(args: argparse.Namespace) -> bool:
    return args.json or not sys.stderr.isatty()


def _bar(args: argparse.Namespace, desc: str, total: int):
    factory = out.progress_bar(not _quiet(args), desc)
    return factory(total) if factory else None


def _update(bar):
    return bar.update if bar is not None else None


def _selected_bytes(manifest, patterns: list[str] | None) -> int:
    """The progress bar's total: the bytes of the tensors the command will read."""
    from resilient.storage.offline.catalog import select

    return sum(manifest.arrays[f].nbytes for f in select(sorted(manifest.arrays), patterns))


# -- commands ---------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    from resilient.storage.offline.catalog import list_checkpoint

    listing = list_checkpoint(args.root)
    out.emit_json(listing) if args.json else out.render_ls(listing)
    return 1 if any(s["committed"] and s["problem"] for s in listing["steps"]) else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from resilient.storage.offline.catalog import DamagedStep, check_patterns_match, open_newest_readable, summarize

    opened, skipped = open_newest_readable(args.url, args.step)
    if isinstance(opened, DamagedStep):  # the step asked for (or every committed one) is damaged
        if args.json:
            out.emit_json({**opened.to_json(), "status": "damaged", "damaged": [d.to_json() for d in skipped]})
        else:
            sys.stderr.write(f"{PROG}: {opened.message} (resilient-ckpt verify --all checks every step)\n")
        return 1
    check_patterns_match([opened], args.tensors)
    summary = {**summarize(opened, args.tensors), "status": "ok", "damaged": [d.to_json() for d in skipped]}
    out.emit_json(summary) if args.json else out.render_inspect(summary)
    return 1 if skipped else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from resilient.storage.offline.catalog import CheckpointRef, check_patterns_match, open_every_step, open_step
    from resilient.storage.offline.convert import StreamConfig
    from resilient.storage.offline.verify import verify_steps

    opened = open_every_step(args.url) if args.all else [open_step(args.url, args.step)]
    refs = [o for o in opened if isinstance(o, CheckpointRef)]
    check_patterns_match(refs, args.tensors)
    bar = _bar(args, "verify", sum(_selected_bytes(r.manifest, args.tensors) for r in refs))
    memory = StreamConfig(max_memory=args.max_memory)
    try:
        reports = verify_steps(
            opened,
            patterns=args.tensors,
            block_bytes=memory.block_bytes,
            budget_bytes=memory.budget_bytes,
            progress=_update(bar),
        )
    finally:
        if bar is not None:
            bar.close()
    result = [r.to_json() for r in reports]
    ok = all(r["ok"] for r in result)
    out.emit_json({"ok": ok, "steps": result}) if args.json else out.render_verify(result)
    return 0 if ok else 1


def cmd_diff(args: argparse.Namespace) -> int:
    from resilient.storage.offline.catalog import check_patterns_match, open_checkpoint
    from resilient.storage.offline.convert import StreamConfig
    from resilient.storage.offline.diff import diff_steps

    a, b = open_checkpoint(args.a), open_checkpoint(args.b)
    check_patterns_match([a, b], args.tensors)
    bar = _bar(args, "diff", _selected_bytes(a.manifest, args.tensors) + _selected_bytes(b.manifest, args.tensors))
    memory = StreamConfig(max_memory=args.max_memory)
    result = diff_steps(
        a,
        b,
        atol=args.atol,
        patterns=args.tensors,
        block_bytes=memory.block_bytes,
        budget_bytes=memory.budget_bytes,
        progress=_update(bar),
    )
    if bar is not None:
        bar.close()
    out.emit_json(result) if args.json else out.render_diff(result)
    return 0 if result["identical"] else 1


def cmd_convert(args: argparse.Namespace) -> int:
    from resilient.storage.offline.convert import ConvertRequest, StreamConfig, convert

    req = ConvertRequest(
        args.src,
        args.dst,
        args.to,
        args.src_format,
        args.step,
        args.out_step,
        args.tensors,
        args.dtype,
        args.trust_pickle,
    )
    config = StreamConfig(max_memory=args.max_memory, max_shard_size=args.max_shard_size)
    bars = []

    def factory(total: int):
        bar = _bar(args, f"convert -> {args.to}", total)
        bars.append(bar)
        return bar

    try:
        result = convert(req, config, factory)
    finally:
        for bar in filter(None, bars):
            bar.close()
    out.emit_json(result) if args.json else out.render_summary(result)
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from resilient.storage.offline.catalog import open_checkpoint
    from resilient.storage.offline.convert import StreamConfig
    from resilient.storage.offline.reshard import chunks_layout, mesh_layout, parse_chunks, parse_mesh, reshard
    from resilient.storage.offline.sink import default_layout

    config = StreamConfig(max_memory=args.max_memory)
    if args.mesh:
        mesh = parse_mesh(args.mesh)
        layout, target = mesh_layout(mesh, config.shard_bytes), {"mesh": mesh}
    else:
        rules = [parse_chunks(r) for r in args.chunks]
        layout = chunks_layout(rules, default_layout(config.shard_bytes), config.budget_bytes)
        target = {"chunks": args.chunks}
    bar = _bar(args, "reshard", open_checkpoint(args.src, args.step).manifest.total_bytes)
    try:
        result = reshard(
            args.src,
            args.dst,
            layout=layout,
            target=target,
            config=config,
            step=args.step,
            out_step=args.out_step,
            progress=_update(bar),
        )
    finally:
        if bar is not None:
            bar.close()
    out.emit_json(result) if args.json else out.render_reshard(result)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from resilient.storage.offline.prune import prune

    result = prune(args.root, args.keep_last, dry_run=args.dry_run)
    out.emit_json(result) if args.json else out.render_prune(result)
    return 0


# -- parser -----------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser, *, tensors: bool = False, memory: bool = False) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (no progress bar)")
    if tensors:
        p.add_argument(
            "--tensors",
            action="append",
            metavar="GLOB",
            help="only tensors (and values) whose FQN matches this glob; repeatable, e.g. 'model.*'",
        )
    if memory:
        p.add_argument(
            "--max-memory",
            type=_size,
            default=1 << 30,
            metavar="SIZE",
            help="peak memory for data in flight (default 1GiB), e.g. 256MiB",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Look inside, verify, compare, convert, reshard and prune resilient "
        "checkpoints, on local paths or s3:// URLs.",
        epilog="exit codes: 0 ok, 1 a finding (corruption, difference), 2 usage, access or machine error "
        "(a full disk), 141 the reader of its output went away (| head)",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="committed steps, orphan attempts, unfinished saves")
    p.add_argument("root", help="checkpoint root (path or s3://bucket/prefix)")
    _common(p)
    p.set_defaults(handler=cmd_ls)

    p = sub.add_parser("inspect", help="manifest summary: mesh, tensors, values")
    p.add_argument("url", help="checkpoint root (newest step) or a step directory")
    p.add_argument("--step", type=int, help="which committed step (default: newest)")
    _common(p, tensors=True)
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("verify", help="read every chunk, check every checksum and the coverage")
    p.add_argument("url", help="checkpoint root or a step directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="which committed step (default: newest)")
    which.add_argument("--all", action="store_true", help="every committed step")
    _common(p, tensors=True, memory=True)
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("diff", help="keys, shapes, dtypes, values and max |a-b| per tensor")
    p.add_argument("a", help="checkpoint root or step directory")
    p.add_argument("b", help="checkpoint root or step directory")
    p.add_argument("--atol", type=_tolerance, default=0.0, help="differences up to this are equal (default 0)")
    _common(p, tensors=True, memory=True)
    p.set_defaults(handler=cmd_diff)

    _add_convert(sub)
    _add_reshard(sub)

    p = sub.add_parser("prune", help="delete old committed steps and orphan attempts")
    p.add_argument("root", help="checkpoint root")
    p.add_argument("--keep-last", type=int, required=True, metavar="N", help="committed steps to keep (>= 1)")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    _common(p)
    p.set_defaults(handler=cmd_prune)
    return parser


def _add_convert(sub) -> None:
    from resilient.storage.offline import FORMATS

    p = sub.add_parser(
        "convert",
        help="resilient <-> safetensors / torch / DCP, streamed",
        description="Convert a checkpoint, tensor by tensor, in bounded memory. The source "
        "format is detected (--from forces it). DCP metadata is a pickle: reading "
        "DCP needs --trust-pickle. torch files are read with weights_only=True.",
    )
    p.add_argument(
        "src",
        help="source: resilient root/step (path or s3://), .safetensors file or directory, "
        "torch file or directory, DCP directory",
    )
    p.add_argument("dst", help="output: resilient root (path or s3://) or a new local directory")
    p.add_argument("--to", required=True, choices=FORMATS, help="output format")
    p.add_argument("--from", dest="src_format", choices=FORMATS, help="source format (default: detected)")
    p.add_argument("--step", type=int, help="source step of a resilient checkpoint (default: newest)")
    p.add_argument("--out-step", type=int, help="step of a resilient output (default: the source's, else 0)")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16 (integers are kept)")
    p.add_argument(
        "--max-shard-size",
        type=_size,
        default=5 << 30,
        metavar="SIZE",
        help="largest output file, e.g. 5GB (default 5GiB; resilient shards stay under max-memory/16)",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow unpickling a DCP .metadata file (it can run code: only for trusted sources)",
    )
    _common(p, tensors=True, memory=True)
    p.set_defaults(handler=cmd_convert)


def _add_reshard(sub) -> None:
    p = sub.add_parser(
        "reshard",
        help="rewrite a step with chunking for another layout (offline)",
        description="Rewrite one step into a new root with shards and inner chunks aligned "
        "to a target mesh or explicit shapes; checksums are recomputed and the "
        "manifest's metadata records resharded_from (the source step and its save-time mesh) "
        "and resharded_to (the target). --mesh takes the trainer's dims (dp_shard, tp) and "
        "those the checkpoint was saved with; a dim that splits no dim of a tensor is named.",
    )
    p.add_argument("src", help="resilient checkpoint root or step directory")
    p.add_argument("dst", help="new resilient root (path or s3://)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--mesh", help="target mesh, e.g. dp_shard=8,tp=4 (outer dim first)")
    target.add_argument(
        "--chunks",
        action="append",
        metavar="GLOB=SHAPE[:INNER]",
        help="shard (and inner) shape for matching tensors, e.g. 'model.*=1024x4096'; repeatable",
    )
    p.add_argument("--step", type=int, help="source step (default: newest)")
    p.add_argument("--out-step", type=int, help="output step (default: the source's)")
    _common(p, memory=True)
    p.set_defaults(handler=cmd_reshard)


def _return_big_buffers_to_os() -> None:
    """glibc raises its mmap threshold after the first large free, after which freed multi-MiB
    blocks stay in per-thread heaps: streaming 256 MiB through a 128 MiB budget then peaked ~140 MiB
    above baseline, ~45 MiB with the threshold pinned at 1 MiB. A process-wide setting, so the CLI
    (not the library) makes it; a no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(m_mmap_threshold, 1 << 20)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return int(e.code or 0)
    _return_big_buffers_to_os()
    try:
        return call_or_stdout_closed(lambda: args.handler(args))
    except IntegrityError as e:  # the checkpoint itself is damaged: a finding
        sys.stderr.write(f"{PROG}: {_one_line(e)}\n")
        return 1
    except (ResilientError, OSError) as e:
        sys.stderr.write(f"{PROG}: error: {_one_line(e)}\n")
        return 2  # (a full disk too: 1 here means a finding in the checkpoint)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        sys.stderr.write(f"{PROG}: unexpected error: {type(e).__name__}: {_one_line(e)} (rerun with --debug)\n")
        return 2


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
