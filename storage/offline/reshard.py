"""Offline resharding: rewrite a step with shards and inner chunks suited to a target layout.

Any checkpoint already loads onto any mesh (reads are by box); what a target layout changes is
efficiency: a rank of the new job should read whole inner chunks and as few shard objects as
possible. ``--mesh dp_shard=8,tp=4`` computes, for every tensor, the boxes the ranks of that mesh
will hold — each tensor keeps the dims its save-time placements shard (``S(d)``, ``_S(d, k)``) with
the new sizes; a tensor saved without placements is split along dim 0 by ``dp_shard``, as FSDP2
does — and aligns the new shard grid with their edges. ``--chunks GLOB=SHAPE[:INNER]`` sets
shard (and inner) shapes explicitly. Checksums are recomputed and the manifest records its origin.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections.abc import Callable

from resilient.dtypes import itemsize
from resilient.errors import ConfigError
from resilient.layout import DEFAULT_INNER_CHUNK_BYTES, Box, choose_inner_shape
from resilient.storage.offline.catalog import open_checkpoint
from resilient.storage.offline.convert import StreamConfig, resilient_sink, stream
from resilient.storage.offline.sink import Layout, output_shard_shape
from resilient.storage.offline.sources import ResilientSource, TensorInfo

_SHARD = re.compile(r"^_?S\((\d+)")
KNOWN_DIM_NAMES = ("dp_shard", "tp")
"""The trainer's mesh dims (``resilient.trainer.parallelize.MESH_DIM_NAMES``; storage may not import
the trainer, a test holds the two equal)."""
SPLITS_NO_TENSOR = ("pp",)
"""Trainer mesh dims that split no tensor: pipeline stages split the layers (a tensor lives whole on
its stage's dp_shard x tp mesh), so ``--mesh pp=2,dp_shard=4,tp=2`` lays out as dp_shard=4,tp=2."""
ChunkRule = tuple[str, tuple[int, ...], tuple[int, ...] | None]  # glob, shard shape, inner shape


def parse_mesh(text: str) -> dict[str, int]:
    """``dp_shard=8,tp=4`` -> {"dp_shard": 8, "tp": 4}."""
    mesh = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not name or not size.isdigit() or int(size) < 1:
            raise ConfigError(f"--mesh entry {part!r} must be NAME=SIZE with SIZE >= 1, e.g. dp_shard=8,tp=4")
        mesh[name.strip()] = int(size)
    if not mesh:
        raise ConfigError("--mesh is empty; e.g. --mesh dp_shard=8,tp=4")
    return mesh


def _shape(text: str, what: str) -> tuple[int, ...]:
    dims = [d for d in re.split(r"[x,]", text.strip()) if d]
    if not dims or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ConfigError(f"{what} {text!r} must be positive integers joined by 'x', e.g. 1024x4096")
    return tuple(int(d) for d in dims)


def parse_chunks(rule: str) -> ChunkRule:
    """``model.*.weight=1024x4096`` or ``...=1024x4096:256x4096`` (shard shape, then inner shape)."""
    glob, sep, shapes = rule.rpartition("=")
    if not sep or not glob:
        raise ConfigError(f"--chunks {rule!r} must be FQN_GLOB=SHAPE[:INNER], e.g. 'model.*=1024x4096'")
    shard_text, _, inner_text = shapes.partition(":")
    return glob, _shape(shard_text, "shard shape"), _shape(inner_text, "inner shape") if inner_text else None


def _torch_chunks(lo: int, n: int, parts: int) -> list[tuple[int, int]]:
    """How ``torch.chunk`` splits [lo, lo + n) into ``parts`` (ceil-sized pieces, maybe fewer)."""
    size = max(1, math.ceil(n / parts))
    return [(lo + s, min(size, n - s)) for s in range(0, n, size)]


def _dim_for(info: TensorInfo, name: str) -> tuple[int | None, str]:
    """The tensor dim the mesh dim ``name`` splits, or None and why it does not apply."""
    if not info.shape:
        return None, "0-d: a scalar is never split"
    if name in SPLITS_NO_TENSOR:
        return None, "pipeline stages split the layers, not a tensor"
    if name in info.mesh_dim_names:
        placement = info.placements[info.mesh_dim_names.index(name)]
        match = _SHARD.match(placement)
        if match is None:
            return None, f"placed {placement} (not sharded) over {name} when saved"
        dim = int(match.group(1))
        if dim >= len(info.shape):
            return None, f"its placement {placement} names a dim a {len(info.shape)}-d tensor lacks"
        return dim, ""
    if info.mesh_dim_names:
        return None, f"saved on a mesh without {name} ({', '.join(info.mesh_dim_names)})"
    if name == "dp_shard":
        return 0, ""  # a plain tensor: FSDP2 shards dim 0
    return None, "saved without a device mesh: only dp_shard splits such a tensor (dim 0, as FSDP2)"


def _split_dims(info: TensorInfo, mesh: dict[str, int]) -> dict[int, list[int]]:
    """Tensor dim -> split counts, innermost first (TP before FSDP, as FSDP2 + TP apply them)."""
    splits: dict[int, list[int]] = {}
    for name, size in reversed(list(mesh.items())):
        dim, _ = _dim_for(info, name)
        if dim is not None and size > 1:
            splits.setdefault(dim, []).append(size)
    return splits


def check_mesh_names(mesh: dict[str, int], infos: list[TensorInfo]) -> None:
    """Reject a dim name that neither the trainer's mesh nor this checkpoint's mesh has: a typo
    (``tp_size=4``) would otherwise split nothing and say nothing."""
    saved = [n for n in dict.fromkeys(n for i in infos for n in i.mesh_dim_names) if n not in KNOWN_DIM_NAMES]
    known = [*KNOWN_DIM_NAMES, *SPLITS_NO_TENSOR, *saved]
    for name in mesh:
        if name not in known:
            also = f", and {', '.join(saved)} from this checkpoint's mesh" if saved else ""
            raise ConfigError(
                f"--mesh dimension {name!r} is unknown; known: {', '.join(KNOWN_DIM_NAMES + SPLITS_NO_TENSOR)} "
                f"(the trainer's mesh){also}; e.g. --mesh dp_shard=8,tp=4"
            )


def not_applied(mesh: dict[str, int], infos: list[TensorInfo]) -> list[dict]:
    """For each mesh dim (of size > 1) and reason, the tensors it does not split (scalars, never
    split by anything, are left out: they would fill every group)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, size in mesh.items():
        if name in SPLITS_NO_TENSOR:
            continue
        for info in infos:
            dim, why = _dim_for(info, name)
            if size > 1 and dim is None and info.shape:
                groups.setdefault((name, why), []).append(info.fqn)
    return [{"dim": name, "size": mesh[name], "reason": why, "tensors": fqns} for (name, why), fqns in groups.items()]


def splits_no_tensor(mesh: dict[str, int]) -> list[dict]:
    """The mesh dims (of size > 1) that split no tensor at all, and why: named, as any dim that
    does not apply is, so that ``--mesh pp=2,...`` does not look as if pp had been ignored."""
    return [
        {
            "dim": name,
            "size": size,
            "reason": "pipeline stages split the layers, not a tensor: every tensor is laid out for the other dims",
        }
        for name, size in mesh.items()
        if name in SPLITS_NO_TENSOR and size > 1
    ]


def source_mesh(infos: list[TensorInfo]) -> dict[str, int] | list[dict[str, int]] | None:
    """The save-time mesh (a list if tensors were saved on several; None: saved without one)."""
    meshes = list(dict.fromkeys(tuple(zip(i.mesh_dim_names, i.mesh_shape, strict=True)) for i in infos if i.mesh_shape))
    if not meshes:
        return None
    return dict(meshes[0]) if len(meshes) == 1 else [dict(m) for m in meshes]


def mesh_boxes(info: TensorInfo, mesh: dict[str, int]) -> list[Box]:
    """The boxes the ranks of ``mesh`` will hold of ``info`` (replicas coincide)."""
    per_dim = []
    for d, n in enumerate(info.shape):
        pieces = [(0, n)]
        for parts in _split_dims(info, mesh).get(d, []):
            pieces = [sub for lo, size in pieces for sub in _torch_chunks(lo, size, parts)]
        per_dim.append(pieces)
    return [Box(tuple(p[0] for p in combo), tuple(p[1] for p in combo)) for combo in itertools.product(*per_dim)]


def mesh_layout(mesh: dict[str, int], shard_bytes: int, inner_bytes: int = DEFAULT_INNER_CHUNK_BYTES) -> Layout:
    def layout(info: TensorInfo) -> tuple[tuple[int, ...], tuple[int, ...]]:
        item = itemsize(info.dtype)
        shard = output_shard_shape(info.shape, mesh_boxes(info, mesh), item, shard_bytes)
        return shard, choose_inner_shape(shard, item, inner_bytes)

    return layout


def chunks_layout(
    rules: list[ChunkRule], fallback: Layout, max_shard_bytes: int, inner_bytes: int = DEFAULT_INNER_CHUNK_BYTES
) -> Layout:
    """The first rule whose glob matches a tensor sets its shapes; other tensors use ``fallback``."""

    def layout(info: TensorInfo) -> tuple[tuple[int, ...], tuple[int, ...]]:
        for glob, shard, inner in rules:
            if fnmatch.fnmatchcase(info.fqn, glob) and info.shape:
                return _checked(info, shard, inner, max_shard_bytes, inner_bytes)
        return fallback(info)

    return layout


def _checked(
    info: TensorInfo, shard: tuple[int, ...], inner: tuple[int, ...] | None, max_shard_bytes: int, inner_bytes: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    item = itemsize(info.dtype)
    if len(shard) != len(info.shape):
        raise ConfigError(
            f"--chunks gives a {len(shard)}-d shard shape {list(shard)} for tensor {info.fqn!r} "
            f"of shape {list(info.shape)}"
        )
    shard = tuple(min(s, max(n, 1)) for s, n in zip(shard, info.shape, strict=True))
    if math.prod(shard) * item > max_shard_bytes:
        raise ConfigError(
            f"--chunks shard {list(shard)} of {info.fqn!r} is {math.prod(shard) * item} bytes; a shard "
            f"is written whole from memory: keep it under {max_shard_bytes} (--max-memory / 4)"
        )
    inner = choose_inner_shape(shard, item, inner_bytes) if inner is None else inner
    if len(inner) != len(shard) or any(s % i for s, i in zip(shard, inner, strict=True)):
        raise ConfigError(
            f"--chunks inner shape {list(inner)} must divide the shard shape {list(shard)} of {info.fqn!r}"
        )
    return shard, inner


def reshard(
    src: str,
    dst: str,
    *,
    layout: Layout,
    target: dict,
    config: StreamConfig,
    step: int | None = None,
    out_step: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Rewrite one step of ``src`` as a new committed step under ``dst`` with ``layout``.

    ``target``: what ``layout`` was made from, ``{"mesh": {name: size}}`` (its names are checked
    against the checkpoint's) or ``{"chunks": [rules]}``; the manifest's metadata records it as
    ``resharded_to``, beside ``resharded_from`` (URL, step, attempt, world size and save-time mesh).
    """
    ref = open_checkpoint(src, step)
    source = ResilientSource(ref)
    state, infos = source.state(), source.tensors()
    if "mesh" in target:
        check_mesh_names(target["mesh"], infos)
    origin = {
        "url": ref.url,
        "step": ref.step,
        "attempt": ref.manifest.attempt,
        "world_size": state.world_size,
        "mesh": source_mesh(infos),
    }
    metadata = {**state.metadata, "resharded_from": origin, "resharded_to": target}
    for info in infos:
        layout(info)  # a bad --chunks rule fails here, before the output root is created
    sink = resilient_sink(dst, ref.step if out_step is None else out_step, layout)
    manifest = stream(source, sink, infos, state, metadata, config, progress)
    shards = sum(len(a.regions) for a in manifest.arrays.values())
    return {
        "src": ref.url,
        "dst": sink.url,
        "step": manifest.step,
        "tensors": len(manifest.arrays),
        "bytes": manifest.total_bytes,
        "shards": shards,
        "resharded_from": origin,
        "resharded_to": target,
        "not_applied": not_applied(target.get("mesh", {}), infos),
        "splits_no_tensor": splits_no_tensor(target.get("mesh", {})),
    }
