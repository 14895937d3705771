"""The manifest: the JSON document whose existence *is* a committed step (format version 3; 1 and 2 are read).

It names every array (FQN, path, shape, dtype, chunking, regions with their writers and data
checksums), the save-time layout, and the non-tensor state as plain JSON. No pickle: loading an
untrusted checkpoint executes no code.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from resilient.errors import ConfigError, IntegrityError

FORMAT_NAME = "resilient"
FORMAT_VERSION = 3
"""What this resilient writes. Version 3 packs a rank's shard objects into a few pack objects (stored
ZIP archives, ``storage/pack.py``; docs/format.md has the decision and its numbers) and records
where each shard lies in its array entry (``shards``): a step's object count no longer grows with
its tensor count. Version 2 wrote each shard as its own object, named with zarr v3's "v2" chunk key
encoding and a "." separator (``<array>/1.0``); version 1 with the "default" one (``<array>/c/1/0``).
The shard bytes and their keys are the same in versions 2 and 3."""
READABLE_VERSIONS = (1, 2, 3)
# The layout's default chunk sizes, here (torch-free) so that a config can name them without torch.
DEFAULT_INNER_CHUNK_BYTES = 1 << 20
"""A resharded load reads whole inner chunks: smaller ones fetch fewer bytes it does not need
(ckpt_bench's ``read_amplification``; benchmarks/README.md, "Choices in the code"); a chunk costs
20 bytes of index and crc, and the save writes the same bytes."""
DEFAULT_MAX_SHARD_BYTES = 1 << 30  # S3 PUTs one object whole: stay far below its 5 GiB limit
MAX_SHARD_BYTES_LIMIT = 2 << 30
"""The largest shard any writer may ask for: a pack is a ZIP without ZIP64 (32-bit sizes and
offsets), and one shard plus its index must fit a pack (``storage.pack.PACK_MAX_BYTES``)."""
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def array_path(fqn: str) -> str:
    """Where a tensor's array lives inside an attempt: its FQN with '.' -> '/'."""
    return fqn.replace(".", "/")


@dataclass(slots=True)
class ArrayEntry:
    fqn: str
    path: str
    shape: list[int]
    dtype: str
    shard_shape: list[int]
    inner_shape: list[int]
    nbytes: int
    placements: list[str]
    mesh_shape: list[int]
    mesh_dim_names: list[str]
    regions: list[dict]  # {"offsets", "sizes", "writer", "crc32c"}
    format_version: int = FORMAT_VERSION  # the manifest's, not stored per array: it names the shard keys
    shards: dict[str, list] = field(default_factory=dict)
    """Version 3: chunk key -> [pack object (under the attempt), offset, nbytes] of every shard."""

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__slots__ if k not in ("fqn", "format_version", "shards")}
        if self.format_version >= 3:
            out["shards"] = self.shards
        return out

    @staticmethod
    def from_json(fqn: str, d: dict, format_version: int) -> ArrayEntry:
        return ArrayEntry(fqn=fqn, **d, format_version=format_version)


@dataclass(slots=True)
class Manifest:
    step: int
    attempt: str
    world_size: int
    arrays: dict[str, ArrayEntry]
    values: dict[str, dict]  # fqn -> {"value": v} or {"per_rank": [v0, v1, ...]}
    metadata: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    created_unix: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    tensorstore: dict[str, dict] = field(default_factory=dict)
    """Version 3: per tensor, the TensorStore spec that opens its array with no code of ours
    (written for readers; this resilient builds its own from ``shards`` and the current root)."""

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "attempt": self.attempt,
            "created_unix": self.created_unix,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_unix)),
            "versions": self.versions,
            "world_size": self.world_size,
            "total_bytes": self.total_bytes,
            "arrays": {fqn: a.to_json() for fqn, a in sorted(self.arrays.items())},
            "values": self.values,
            "metadata": self.metadata,
            **({"tensorstore": self.tensorstore} if self.tensorstore else {}),
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @staticmethod
    def loads(data: bytes, *, where: str) -> Manifest:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise IntegrityError(f"manifest {where} is not valid JSON ({e}); the step is damaged") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise IntegrityError(f"{where} is not a resilient manifest (format={d.get('format')!r})")
        version = d.get("format_version")
        if type(version) is not int or version not in READABLE_VERSIONS:  # (True == 1 in Python)
            # Not damage: a newer writer. A restore must not fall back past it (nor set it aside).
            raise ConfigError(
                f"manifest {where} has format version {version}; this resilient reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade resilient"
            )
        return Manifest(
            step=d["step"],
            attempt=d["attempt"],
            world_size=d["world_size"],
            arrays={fqn: ArrayEntry.from_json(fqn, a, version) for fqn, a in d["arrays"].items()},
            values=d["values"],
            metadata=d.get("metadata", {}),
            versions=d.get("versions", {}),
            created_unix=d.get("created_unix", 0.0),
            format_version=version,
        )


def library_versions() -> dict[str, str]:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for name in ("resilient", "torch", "tensorstore"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "unknown"
    return out


def encode_values(per_rank: list[dict[str, Any]]) -> dict[str, dict]:
    """JSON leaves of every rank: one value when all ranks agree, else one per rank."""
    out: dict[str, dict] = {}
    for fqn in per_rank[0]:
        vals = [r.get(fqn) for r in per_rank]
        same = all(json.dumps(v, sort_keys=True) == json.dumps(vals[0], sort_keys=True) for v in vals)
        out[fqn] = {"value": vals[0]} if same else {"per_rank": vals}
    return out
