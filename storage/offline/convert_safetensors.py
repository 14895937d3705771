"""safetensors in both directions, streamed: no tensor is ever whole in memory.

The format is an 8-byte header length, a JSON header (dtype, shape, byte range of every tensor)
and the raw little-endian bytes. Because the header only needs shapes, the exporter writes it
first and then each C-order block straight to its file offset; the importer reads any box with
positioned reads. Export follows the Hugging Face layout: ``model-00001-of-00003.safetensors`` +
``model.safetensors.index.json``. The non-tensor state and the step ride along as JSON in
``__metadata__["resilient"]`` (safetensors metadata is str -> str), so a round trip keeps them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct

import numpy as np

from resilient.dtypes import itemsize
from resilient.errors import ConfigError, IntegrityError
from resilient.layout import Box
from resilient.storage.offline.sources import SourceState, TensorInfo
from resilient.storage.offline.streaming import Done, c_order_blocks, linear_offset, numpy_dtype

INDEX = "model.safetensors.index.json"
_TO_ST = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}
_MAX_HEADER = 100 << 20


def pack_files(infos: list[TensorInfo], max_file_bytes: int) -> list[list[TensorInfo]]:
    """Consecutive tensors per file up to ``max_file_bytes``; a bigger tensor gets a file alone."""
    files: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        nbytes = math.prod(info.shape) * itemsize(info.dtype)
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(info)
        size += nbytes
    return [f for f in files if f]


class SafetensorsSink:
    format = "safetensors"

    def __init__(self, directory: str, *, max_file_bytes: int, block_bytes: int) -> None:
        self.directory, self.max_file_bytes, self.block_bytes = directory, max_file_bytes, block_bytes
        self._where: dict[str, tuple[int, int]] = {}  # fqn -> (fd, absolute offset of its data)
        self._fds: list[int] = []
        self._weight_map: dict[str, str] = {}
        self._index_meta: dict = {}

    def begin(self, infos: list[TensorInfo], state: SourceState, metadata: dict) -> None:
        for info in infos:
            if info.dtype not in _TO_ST:
                raise ConfigError(
                    f"tensor {info.fqn!r} has dtype {info.dtype}, which safetensors cannot hold; "
                    "leave it out with --tensors or cast it with --dtype"
                )
        carried = json.dumps(
            {"step": state.step, "world_size": state.world_size, "values": state.values, "metadata": metadata}
        )
        groups = pack_files(infos, self.max_file_bytes)
        os.makedirs(self.directory, exist_ok=True)
        for i, group in enumerate(groups):
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            self._open_file(os.path.join(self.directory, name), group, {"format": "pt", "resilient": carried})
            self._weight_map.update({info.fqn: name for info in group})
        total = sum(math.prod(i.shape) * itemsize(i.dtype) for i in infos)
        self._index_meta = {"total_size": total, "resilient": carried}

    def _open_file(self, path: str, group: list[TensorInfo], meta: dict) -> None:
        header: dict = {"__metadata__": meta}
        offset = 0
        for info in group:
            nbytes = math.prod(info.shape) * itemsize(info.dtype)
            header[info.fqn] = {
                "dtype": _TO_ST[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the reference writer does
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds.append(fd)
        os.pwrite(fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(fd, 8 + len(text) + offset)
        for info in group:
            self._where[info.fqn] = (fd, 8 + len(text) + header[info.fqn]["data_offsets"][0])

    def blocks(self, info: TensorInfo) -> list[Box]:
        return list(c_order_blocks(info.whole, itemsize(info.dtype), self.block_bytes))

    def write(self, info: TensorInfo, box: Box, data: np.ndarray) -> None:
        fd, base = self._where[info.fqn]
        start = linear_offset(info.shape, box.offsets) * itemsize(info.dtype) if info.shape else 0
        os.pwrite(fd, np.require(data, requirements="C").reshape(-1).view(np.uint8).data, base + start)

    def finish(self) -> dict:
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        # The index goes last: a directory without it is an export that did not finish.
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump({"metadata": self._index_meta, "weight_map": self._weight_map}, f, indent=1)
        return {"files": sorted(set(self._weight_map.values())), "index": INDEX}


# -- import -----------------------------------------------------------------------------------


def _read_header(path: str) -> tuple[dict, int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise IntegrityError(f"{path} is not a safetensors file: shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise IntegrityError(f"{path} is not a safetensors file (header length {length} vs file size {size})")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise IntegrityError(f"{path} has a damaged safetensors header: {e}") from e
    return header, 8 + length


def safetensors_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ConfigError(f"no .safetensors file in {path}")
    return [os.path.join(path, n) for n in names]


class SafetensorsSource:
    format = "safetensors"

    def __init__(self, path: str) -> None:
        self.url = path
        self._entries: dict[str, tuple[str, int, TensorInfo]] = {}  # fqn -> (file, data offset, info)
        self._carried: dict = {}
        for file in safetensors_files(path):
            self._add_file(file)
        self._files: dict[str, object] = {}

    def _add_file(self, file: str) -> None:
        header, data_start = _read_header(file)
        meta = header.pop("__metadata__", None) or {}
        if "resilient" in meta and not self._carried:
            self._carried = json.loads(meta["resilient"])
        size = os.path.getsize(file)
        for fqn, h in header.items():
            if h.get("dtype") not in _FROM_ST:
                raise ConfigError(
                    f"tensor {fqn!r} in {file} has safetensors dtype {h.get('dtype')!r}, "
                    f"which resilient does not support"
                )
            info = TensorInfo(fqn, tuple(h["shape"]), _FROM_ST[h["dtype"]])
            begin, end = h["data_offsets"]
            if end - begin != math.prod(info.shape) * itemsize(info.dtype) or data_start + end > size:
                raise IntegrityError(
                    f"tensor {fqn!r} in {file}: byte range {begin}..{end} does not match shape "
                    f"{list(info.shape)} {info.dtype} or runs past the end of the file (truncated?)"
                )
            self._entries[fqn] = (file, data_start + begin, info)

    def tensors(self) -> list[TensorInfo]:
        return [self._entries[k][2] for k in sorted(self._entries)]

    def state(self) -> SourceState:
        c = self._carried
        return SourceState(
            step=c.get("step"),
            world_size=c.get("world_size", 1),
            values=c.get("values", {}),
            metadata=c.get("metadata", {}),
        )

    def read(self, fqn: str, box: Box) -> Done:
        file, base, info = self._entries[fqn]
        if file not in self._files:
            self._files[file] = open(file, "rb")  # noqa: SIM115 -- kept open across reads, closed in close()
        return Done(read_box(self._files[file], base, info, box))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def read_box(f, base: int, info: TensorInfo, box: Box) -> np.ndarray:
    """Read ``box`` of a C-order tensor stored at ``base`` in ``f``, one positioned read per run."""
    out = np.empty(box.sizes, numpy_dtype(info.dtype))
    if out.size == 0:
        return out
    shape, item = info.shape, out.itemsize
    partial = [d for d in range(len(shape)) if box.sizes[d] != shape[d]]
    j = partial[-1] if partial else 0  # dims after j are whole: a run spans dim j and everything after
    run = box.sizes[j] * math.prod(shape[j + 1 :]) if shape else 1
    rows = out.reshape(-1, run)
    outer = itertools.product(*[range(o, o + s) for o, s in zip(box.offsets[:j], box.sizes[:j], strict=True)])
    for row, index in zip(rows, outer, strict=True):
        start = linear_offset(shape, (*index, *box.offsets[j:]))  # dims after j are whole: offset 0
        f.seek(base + start * item)
        view = memoryview(row.view(np.uint8))
        if f.readinto(view) != view.nbytes:
            where = base + start * item
            raise IntegrityError(f"tensor {info.fqn!r} in {f.name} is truncated: short read at byte {where}")
    return out
