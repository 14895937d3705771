"""Convert between resilient, safetensors, torch and DCP checkpoints, tensor by tensor, in bounded memory.

A source (``sources.py`` and the ``convert_*`` modules) yields boxes of tensors; a sink wants
blocks (shards for resilient, C-order ranges for the flat formats). ``stream`` moves one into the
other through a byte-bounded pipeline: at most ``max_memory / 4`` of blocks in flight, each at most
``max_memory / 16`` (and 16 MiB). The factor of 4 is measured, not guessed: a TensorStore read holds the stored
bytes, the decoded chunk and the output array at once, and the allocator keeps some slack, so the
process peaks at about 2-3x the bytes in flight. Peak memory stays under ``--max-memory`` whatever
the checkpoint's size (tests/tools/test_ckpt_convert.py measures it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from resilient.dtypes import itemsize
from resilient.errors import ConfigError, StorageError
from resilient.layout import Box
from resilient.manifest import LATEST, MANIFEST, MAX_SHARD_BYTES_LIMIT, parse_step_dir
from resilient.storage.offline import FORMATS
from resilient.storage.offline.catalog import open_checkpoint, select, split_step_url
from resilient.storage.offline.sink import Layout, ResilientSink, default_layout
from resilient.storage.offline.sources import ResilientSource, SourceState, TensorInfo, TensorSource
from resilient.storage.offline.streaming import FLOAT_DTYPES, Pending, Pipeline, numpy_dtype


class TensorSink(Protocol):
    format: str

    def begin(self, infos: list[TensorInfo], state: SourceState, metadata: dict) -> None: ...
    def blocks(self, info: TensorInfo) -> list[Box]: ...
    def write(self, info: TensorInfo, box: Box, data: np.ndarray) -> Pending | None: ...
    def finish(self) -> Any: ...


@dataclass(kw_only=True, slots=True)
class StreamConfig:
    max_memory: int = 1 << 30
    """Bytes the conversion may hold: blocks in flight plus the copies a cast or a write makes."""
    max_shard_size: int = 5 << 30
    """Largest output file (safetensors/torch) or shard object (resilient)."""

    def __post_init__(self) -> None:
        if self.max_memory < 16 << 20:
            raise ConfigError(f"max_memory must be at least 16 MiB, got {self.max_memory}")
        if self.max_shard_size < 1 << 10:
            raise ConfigError(f"max_shard_size must be at least 1 KiB, got {self.max_shard_size}")

    @property
    def block_bytes(self) -> int:
        """Read/write block. Capped at 16 MiB: fresh multi-MiB buffers cost page faults, and small
        blocks keep more I/O in flight (1 GiB to safetensors: 4.7 s with 64 MiB blocks, 3.2 s with 16)."""
        return max(1 << 20, min(16 << 20, self.max_memory // 16))

    @property
    def shard_bytes(self) -> int:
        """Largest shard object of a resilient output; each is written whole from one block in
        memory, and never over the format's limit (a pack is a ZIP with 32-bit sizes)."""
        return max(1 << 20, min(self.max_shard_size, self.max_memory // 16, MAX_SHARD_BYTES_LIMIT))

    @property
    def budget_bytes(self) -> int:
        return self.max_memory // 4


# -- format detection and opening ---------------------------------------------------------------


def _is_resilient_dir(path: str, names: set[str]) -> bool:
    return (
        MANIFEST in names
        or LATEST in names
        or any(parse_step_dir(n) is not None for n in names)
        or (parse_step_dir(os.path.basename(path)) is not None)
    )


def detect_format(url: str) -> str:
    """What a checkpoint at ``url`` is, from its files (``--from`` overrides)."""
    if "://" in url and not url.startswith("file://"):
        return "resilient"
    path = url.removeprefix("file://")
    if not os.path.exists(path):
        raise StorageError(f"{path} does not exist; check the path")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return "safetensors"
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic[:2] == b"PK" or magic[:1] == b"\x80":  # torch.save's zip container, or a legacy pickle
            return "torch"
    else:
        names = set(os.listdir(path))
        if _is_resilient_dir(path, names):
            return "resilient"
        if ".metadata" in names:
            return "dcp"
        if any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        if any(n.endswith((".bin", ".pt", ".pth", ".bin.index.json")) for n in names):
            return "torch"
    raise ConfigError(
        f"cannot tell the format of {url} (not resilient, safetensors, torch or DCP); "
        "pass --from FORMAT if it is one of them"
    )


def open_source(
    url: str, fmt: str, *, step: int | None = None, trust_pickle: bool = False, cache_bytes: int = 256 << 20
) -> TensorSource:
    if fmt == "resilient":
        return ResilientSource(open_checkpoint(url, step))
    path = _local_path(url, "read")
    if not os.path.exists(path):
        raise StorageError(f"{path} does not exist; check the path")
    if fmt == "safetensors":
        from resilient.storage.offline.convert_safetensors import SafetensorsSource

        return SafetensorsSource(path)
    if fmt == "torch":
        from resilient.storage.offline.convert_torch import TorchSource

        return TorchSource(path)
    if fmt == "dcp":
        from resilient.storage.offline.convert_dcp import DcpSource

        return DcpSource(path, trust_pickle=trust_pickle, cache_bytes=cache_bytes)
    raise ConfigError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def _local_path(url: str, verb: str) -> str:
    if "://" in url and not url.startswith("file://"):
        raise ConfigError(
            f"safetensors, torch and DCP checkpoints are {verb} on local disk only, got {url}; "
            "use a local directory and copy it to or from S3 (resilient checkpoints take s3:// URLs)"
        )
    return os.path.abspath(url.removeprefix("file://"))


def _empty_target(url: str) -> str:
    path = _local_path(url, "written")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"output {path} exists and is not an empty directory; choose a new one")
    return path


# -- the stream ---------------------------------------------------------------------------------


def cast_function(src_dtype: str, dst_dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    if src_dtype == dst_dtype:
        return lambda a: a
    target = numpy_dtype(dst_dtype)
    return lambda a: a.astype(target)


def output_infos(infos: list[TensorInfo], dtype: str | None) -> list[TensorInfo]:
    """``--dtype`` casts floating-point tensors only: integer counters and masks keep their type."""
    if dtype is None:
        return list(infos)
    if dtype not in FLOAT_DTYPES:
        raise ConfigError(f"--dtype must be a floating-point type ({', '.join(FLOAT_DTYPES)}), got {dtype!r}")
    return [replace(i, dtype=dtype) if i.dtype in FLOAT_DTYPES else i for i in infos]


def stream(
    source: TensorSource,
    sink: TensorSink,
    infos: list[TensorInfo],
    state: SourceState,
    metadata: dict,
    config: StreamConfig,
    progress: Callable[[int], None] | None = None,
) -> Any:
    """Move every tensor of ``infos`` (output dtypes) from ``source`` into ``sink``; returns ``finish()``."""
    src_dtype = {i.fqn: i.dtype for i in source.tensors()}
    sink.begin(infos, state, metadata)
    pipeline = Pipeline(config.budget_bytes)
    try:
        for info in infos:
            cast = cast_function(src_dtype[info.fqn], info.dtype)
            # A cast holds the source block and its converted copy at once.
            per_element = itemsize(src_dtype[info.fqn]) + (
                itemsize(info.dtype) if src_dtype[info.fqn] != info.dtype else 0
            )
            for box in sink.blocks(info):
                pipeline.add(
                    box.numel * per_element,
                    lambda f=info.fqn, b=box: source.read(f, b),
                    lambda data, i=info, b=box, c=cast: _deliver(sink, i, b, c(data), progress),
                )
        pipeline.drain()
    except BaseException:
        abort = getattr(sink, "abort", None)  # a source error leaves the sink's open pack to close
        if abort is not None:
            abort()
        raise
    return sink.finish()


def _deliver(
    sink: TensorSink, info: TensorInfo, box: Box, data: np.ndarray, progress: Callable[[int], None] | None
) -> Pending | None:
    if progress:
        progress(data.nbytes)
    return sink.write(info, box, data)


@dataclass(slots=True)
class ConvertRequest:
    src: str
    dst: str
    to: str
    src_format: str | None = None
    step: int | None = None
    out_step: int | None = None
    patterns: list[str] | None = None
    dtype: str | None = None
    trust_pickle: bool = False


def convert(req: ConvertRequest, config: StreamConfig, progress_factory: Callable[[int], Any] | None = None) -> dict:
    """Convert ``req.src`` into a new checkpoint at ``req.dst``; returns a summary."""
    if req.to not in FORMATS:
        raise ConfigError(f"unknown output format {req.to!r}; use one of {', '.join(FORMATS)}")
    start = time.perf_counter()
    fmt = req.src_format or detect_format(req.src)
    source = open_source(req.src, fmt, step=req.step, trust_pickle=req.trust_pickle, cache_bytes=config.budget_bytes)
    try:
        chosen = set(select([i.fqn for i in source.tensors()], req.patterns))
        if not chosen:
            raise ConfigError(f"no tensor of {req.src} matches --tensors {' '.join(req.patterns or [])}")
        infos = output_infos([i for i in source.tensors() if i.fqn in chosen], req.dtype)
        state = _selected_state(source.state(), req.patterns)
        metadata = {**state.metadata, "converted_from": {"format": fmt, "url": source.url, "step": state.step}}
        progress = progress_factory(sum(_nbytes(i) for i in infos)) if progress_factory else None
        result = _write(source, infos, state, metadata, req, config, progress)
    finally:
        source.close()
    total = sum(_nbytes(i) for i in infos)
    return {
        "src": req.src,
        "dst": req.dst,
        "from": fmt,
        "to": req.to,
        "tensors": len(infos),
        "bytes": total,
        "values": len(state.values),
        "seconds": round(time.perf_counter() - start, 3),
        **result,
    }


def _nbytes(info: TensorInfo) -> int:
    size = itemsize(info.dtype)
    for n in info.shape:
        size *= n
    return size


def _selected_state(state: SourceState, patterns: list[str] | None) -> SourceState:
    keep = select(sorted(state.values), patterns)
    return SourceState(state.step, state.world_size, {k: state.values[k] for k in keep}, state.metadata)


def _write(
    source: TensorSource,
    infos: list[TensorInfo],
    state: SourceState,
    metadata: dict,
    req: ConvertRequest,
    config: StreamConfig,
    progress: Callable[[int], None] | None,
) -> dict:
    update = getattr(progress, "update", None)
    if req.to == "resilient":
        sink = resilient_sink(
            req.dst, req.out_step if req.out_step is not None else (state.step or 0), default_layout(config.shard_bytes)
        )
        manifest = stream(source, sink, infos, state, metadata, config, update)
        return {"step": manifest.step, "url": sink.url}
    directory = _empty_target(req.dst)
    if req.to == "dcp":
        from resilient.storage.offline.convert_dcp import write_dcp

        src_dtype = {i.fqn: i.dtype for i in source.tensors()}
        casts = {i.fqn: cast_function(src_dtype[i.fqn], i.dtype) for i in infos}
        return write_dcp(source, infos, casts, state, directory, block_bytes=config.block_bytes, on_block=update)
    if req.to == "safetensors":
        from resilient.storage.offline.convert_safetensors import SafetensorsSink

        sink = SafetensorsSink(directory, max_file_bytes=config.max_shard_size, block_bytes=config.block_bytes)
    else:
        from resilient.storage.offline.convert_torch import TorchSink

        sink = TorchSink(
            directory, max_file_bytes=min(config.max_shard_size, config.budget_bytes), block_bytes=config.block_bytes
        )
    return stream(source, sink, infos, state, metadata, config, update)


def resilient_sink(url: str, step: int, layout: Layout) -> ResilientSink:
    """A sink at a checkpoint root (a step directory URL names the step too)."""
    location, url_step = split_step_url(url)
    if url_step is not None and url_step != step:
        raise ConfigError(f"output {url} names step {url_step} but the step to write is {step}; pass --out-step")
    return ResilientSink(location, step, layout)
