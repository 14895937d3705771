"""``torch.save`` files in both directions, never unpickling arbitrary objects.

Import uses ``torch.load(weights_only=True)`` only: its restricted unpickler builds tensors and
plain containers and refuses anything else, so a hostile file cannot run code. Files are mapped
(``mmap=True``) and opened one at a time, so only the pages a read touches come into memory.
Export writes the Hugging Face layout ``pytorch_model-00001-of-00002.bin`` +
``pytorch_model.bin.index.json``: ``torch.save`` needs every tensor of a file whole in memory, so
files are capped at a quarter of ``--max-memory`` (safetensors export has no such limit).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

from resilient.dtypes import from_numpy, itemsize, to_numpy, torch_dtype, zarr_name
from resilient.errors import ConfigError, IntegrityError
from resilient.layout import Box
from resilient.state import flatten_state
from resilient.storage.offline.convert_safetensors import pack_files
from resilient.storage.offline.sources import SourceState, TensorInfo
from resilient.storage.offline.streaming import Done, c_order_blocks, linear_offset

INDEX = "pytorch_model.bin.index.json"
_SUFFIXES = (".bin", ".pt", ".pth")


class TorchSink:
    format = "torch"

    def __init__(self, directory: str, *, max_file_bytes: int, block_bytes: int) -> None:
        self.directory, self.max_file_bytes, self.block_bytes = directory, max_file_bytes, block_bytes
        self._file_of: dict[str, int] = {}
        self._groups: list[list[TensorInfo]] = []
        self._names: list[str] = []
        self._left: list[int] = []  # bytes still to arrive per file
        self._held: dict[str, torch.Tensor] = {}  # tensors of the file being filled
        self._saved: set[int] = set()
        self._meta: dict = {}

    def begin(self, infos: list[TensorInfo], state: SourceState, metadata: dict) -> None:
        for info in infos:
            nbytes = math.prod(info.shape) * itemsize(info.dtype)
            if nbytes > self.max_file_bytes:
                raise ConfigError(
                    f"tensor {info.fqn!r} ({nbytes / 2**20:.0f} MiB) is larger than a torch file may be "
                    f"({self.max_file_bytes / 2**20:.0f} MiB = min(--max-shard-size, --max-memory / 4)); "
                    "torch.save needs it whole in RAM: raise --max-memory, or export to safetensors"
                )
        self._groups = pack_files(infos, self.max_file_bytes)
        self._names = [f"pytorch_model-{i + 1:05d}-of-{len(self._groups):05d}.bin" for i in range(len(self._groups))]
        for i, group in enumerate(self._groups):
            self._file_of.update({info.fqn: i for info in group})
        self._left = [sum(math.prod(i.shape) * itemsize(i.dtype) for i in g) for g in self._groups]
        self._meta = {
            "total_size": sum(self._left),
            "resilient": {
                "step": state.step,
                "world_size": state.world_size,
                "values": state.values,
                "metadata": metadata,
            },
        }
        os.makedirs(self.directory, exist_ok=True)

    def blocks(self, info: TensorInfo) -> list[Box]:
        return list(c_order_blocks(info.whole, itemsize(info.dtype), self.block_bytes))

    def write(self, info: TensorInfo, box: Box, data: np.ndarray) -> None:
        if info.fqn not in self._held:
            self._held[info.fqn] = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        flat = self._held[info.fqn].reshape(-1)
        start = linear_offset(info.shape, box.offsets) if info.shape else 0
        block = from_numpy(np.require(data, requirements="C"), torch_dtype(info.dtype)).reshape(-1)
        flat[start : start + block.numel()].copy_(block)
        index = self._file_of[info.fqn]
        self._left[index] -= data.nbytes
        if self._left[index] == 0:
            self._save(index)

    def _save(self, index: int) -> None:
        tensors = {}
        for info in self._groups[index]:
            held = self._held.pop(info.fqn, None)
            tensors[info.fqn] = held if held is not None else torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        torch.save(tensors, os.path.join(self.directory, self._names[index]))
        self._saved.add(index)

    def finish(self) -> dict:
        for index in range(len(self._groups)):
            if index not in self._saved:  # only empty tensors in it: nothing ever arrived
                self._save(index)
        weight_map = {info.fqn: self._names[i] for i, g in enumerate(self._groups) for info in g}
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump({"metadata": self._meta, "weight_map": weight_map}, f, indent=1)
        return {"files": self._names, "index": INDEX}


# -- import -----------------------------------------------------------------------------------


def torch_files(path: str) -> tuple[list[str], dict]:
    """The files of a torch export (index first, else every .bin/.pt/.pth) and the carried state."""
    if os.path.isfile(path):
        return [path], {}
    indexes = sorted(n for n in os.listdir(path) if n.endswith(".index.json") and not n.startswith("model."))
    if indexes:
        with open(os.path.join(path, indexes[0])) as f:
            index = json.load(f)
        names = list(dict.fromkeys(index["weight_map"].values()))
        return [os.path.join(path, n) for n in names], index.get("metadata", {}).get("resilient", {})
    names = sorted(n for n in os.listdir(path) if n.endswith(_SUFFIXES))
    if not names:
        raise ConfigError(f"no torch file ({', '.join(_SUFFIXES)}) in {path}")
    return [os.path.join(path, n) for n in names], {}


def _load(file: str) -> dict:
    try:
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # the legacy (pre-zip) format cannot be mapped; anything else is real
                raise
            obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise IntegrityError(
            f"{file} is not a loadable torch file with weights_only=True ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); resilient never unpickles arbitrary objects"
        ) from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{file} holds a {type(obj).__name__}, not a state dict")
    return obj


class TorchSource:
    format = "torch"

    def __init__(self, path: str) -> None:
        self.url = path
        files, self._carried = torch_files(path)
        self._infos: list[TensorInfo] = []
        self._file_of: dict[str, str] = {}
        self._values: dict[str, dict] = {}
        for file in files:
            for fqn, leaf in flatten_state(_load(file)).items():
                if leaf.is_tensor:
                    t = leaf.value
                    self._infos.append(TensorInfo(fqn, tuple(t.shape), zarr_name(t.dtype, fqn=fqn)))
                    self._file_of[fqn] = file
                else:
                    self._values[fqn] = {"value": leaf.value}
        self._current: tuple[str, dict] | None = None  # one file mapped at a time

    def tensors(self) -> list[TensorInfo]:
        return list(self._infos)

    def state(self) -> SourceState:
        c = self._carried
        return SourceState(
            step=c.get("step"),
            world_size=c.get("world_size", 1),
            values=c.get("values", self._values),
            metadata=c.get("metadata", {}),
        )

    def read(self, fqn: str, box: Box) -> Done:
        file = self._file_of[fqn]
        if self._current is None or self._current[0] != file:
            self._current = None  # unmap the previous file before mapping the next
            self._current = (file, {k: leaf.value for k, leaf in flatten_state(_load(file)).items()})
        tensor = self._current[1][fqn]
        piece = tensor[box.slices()] if tensor.dim() else tensor
        return Done(to_numpy(piece.contiguous()).copy())

    def close(self) -> None:
        self._current = None
