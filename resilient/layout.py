"""Where each piece of a tensor lives: boxes in global coordinates, and the save plan.

A *box* is a rectangular region of a tensor's global shape (offsets + sizes). Each rank holds one
box of every tensor (DTensor placements decide which; a plain tensor is the whole tensor on every
rank). The plan turns the boxes of all ranks into: one zarr shard grid per array whose shards
never straddle two boxes (so every rank writes whole objects, no read-modify-write, no locks),
inner chunks of a few MiB, and *regions* — each shard-aligned piece of a box assigned to exactly
one writer, replicas spread across the ranks that hold them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from resilient.dtypes import itemsize, zarr_name
from resilient.errors import StateError
from resilient.manifest import DEFAULT_INNER_CHUNK_BYTES as DEFAULT_INNER_CHUNK_BYTES
from resilient.manifest import DEFAULT_MAX_SHARD_BYTES as DEFAULT_MAX_SHARD_BYTES

# A replicated box smaller than this is written whole by one replica: splitting it buys nothing.
MIN_SPLIT_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def intersect(self, other: Box) -> Box | None:
        lo = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        hi = [
            min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        ]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}

    @staticmethod
    def from_json(d: dict) -> Box:
        return Box(tuple(d["offsets"]), tuple(d["sizes"]))


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """What one rank holds of one tensor: its global shape, its box and the local data."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    box: Box | None  # None: this rank holds no elements
    data: torch.Tensor
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]


def describe_local(fqn: str, tensor: torch.Tensor) -> LocalTensor:
    """The box this rank holds of ``tensor``: DTensor offsets come from its chunk list (what DCP
    uses), never from rank arithmetic — with FSDP2+TP's _StridedShard, rank order != offset order."""
    from torch.distributed.tensor import DTensor

    dtype = zarr_name(tensor.dtype, fqn=fqn)
    if isinstance(tensor, DTensor):
        chunks = tensor.__create_chunk_list__()
        if len(chunks) != 1:
            raise StateError(f"DTensor {fqn!r} has {len(chunks)} local chunks; resilient expects one")
        chunk = chunks[0]
        local = tensor.to_local()
        box = Box(tuple(chunk.offsets), tuple(chunk.sizes)) if local.numel() > 0 else None
        mesh = tensor.device_mesh
        return LocalTensor(
            fqn,
            tuple(tensor.shape),
            dtype,
            box,
            local,
            tuple(str(p) for p in tensor.placements),
            tuple(mesh.shape),
            tuple(mesh.mesh_dim_names or ()),
        )
    # A meta tensor is a placeholder (resilient.state.placeholder): named here, held by other ranks.
    box = Box((0,) * tensor.dim(), tuple(tensor.shape)) if tensor.numel() > 0 and not tensor.is_meta else None
    return LocalTensor(fqn, tuple(tensor.shape), dtype, box, tensor, (), (), ())


@dataclass(frozen=True, slots=True)
class Region:
    """A shard-aligned piece of an array written by exactly one rank."""

    box: Box
    writer: int


@dataclass(slots=True)
class ArrayPlan:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    shard_shape: tuple[int, ...]
    inner_shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    regions: list[Region] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def shard_grid(self) -> tuple[int, ...]:
        return tuple(math.ceil(n / s) if n else 0 for n, s in zip(self.shape, self.shard_shape, strict=True))


# ---------------------------------------------------------------------------------------------
# grid arithmetic


def _divisors(n: int) -> list[int]:
    small, large = [], []
    for k in range(1, math.isqrt(n) + 1):
        if n % k == 0:
            small.append(k)
            if k != n // k:
                large.append(n // k)
    return small + large[::-1]


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max((d for d in _divisors(n) if d <= limit), default=1)


def _smallest_divisor_at_least(n: int, need: int) -> int:
    return min((d for d in _divisors(n) if d >= need), default=n)


def edge_grid(shape: tuple[int, ...], boxes: list[Box]) -> list[int]:
    """Per dim, the largest chunk length that every box edge falls on (gcd of interior edges)."""
    grid = []
    for d, n in enumerate(shape):
        g = 0
        for box in boxes:
            for edge in (box.offsets[d], box.offsets[d] + box.sizes[d]):
                if 0 < edge < n:
                    g = math.gcd(g, edge)
        grid.append(g or max(n, 1))
    return grid


def choose_shard_shape(
    shape: tuple[int, ...], boxes: list[Box], holders: list[int], item: int, max_shard_bytes: int
) -> tuple[int, ...]:
    """Shards align with every box edge; big replicated boxes split so replicas share the write."""
    shard = edge_grid(shape, boxes)
    if shard and max(holders, default=1) > 1:
        biggest = max(b.numel for b in boxes) * item
        if biggest >= MIN_SPLIT_BYTES:
            shard[0] = _largest_divisor_at_most(shard[0], max(1, math.ceil(shard[0] / max(holders))))
    for d in range(len(shard)):
        if math.prod(shard) * item <= max_shard_bytes:
            break
        need = math.ceil(math.prod(shard) * item / max_shard_bytes)
        shard[d] = shard[d] // _smallest_divisor_at_least(shard[d], need)
    return tuple(shard)


def choose_inner_shape(shard: tuple[int, ...], item: int, target_bytes: int) -> tuple[int, ...]:
    """Inner chunks of about ``target_bytes``, dividing the shard, split along dim 0 first (the
    dim FSDP shards, so the one most likely to be resharded), then dim 1, and so on."""
    inner = list(shard)
    for d in range(len(inner)):
        nbytes = math.prod(inner) * item
        if nbytes <= target_bytes:
            break
        need = math.ceil(nbytes / target_bytes)
        inner[d] = shard[d] // _smallest_divisor_at_least(shard[d], need)
    return tuple(inner)


def _split_rows(box: Box, shard0: int, parts: int) -> list[Box]:
    """Split ``box`` along dim 0 at shard boundaries into at most ``parts`` boxes."""
    if not box.sizes or parts <= 1:
        return [box]
    units = math.ceil(box.sizes[0] / shard0)
    parts = min(parts, units)
    out = []
    for i in range(parts):
        lo = box.offsets[0] + (i * units // parts) * shard0
        hi = min(box.offsets[0] + ((i + 1) * units // parts) * shard0, box.offsets[0] + box.sizes[0])
        out.append(Box((lo, *box.offsets[1:]), (hi - lo, *box.sizes[1:])))
    return out


# ---------------------------------------------------------------------------------------------
# the plan


def _check_consistent(fqn: str, infos: list[tuple[int, dict]], world_size: int) -> None:
    ranks = sorted(r for r, _ in infos)
    if len(ranks) != world_size:
        missing = sorted(set(range(world_size)) - set(ranks))
        raise StateError(
            f"tensor {fqn!r} is in the state of ranks {ranks} but not of ranks {missing}; "
            "every rank must pass the same keys to save()"
        )
    first = infos[0][1]
    for rank, info in infos[1:]:
        if info["shape"] != first["shape"] or info["dtype"] != first["dtype"]:
            raise StateError(
                f"tensor {fqn!r} has global shape {info['shape']} dtype {info['dtype']} on rank "
                f"{rank} but {first['shape']} {first['dtype']} on rank {infos[0][0]}"
            )


def _check_coverage(fqn: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    covered = sum(b.numel for b in boxes)
    overlap = any(a.intersect(b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    if covered != math.prod(shape) or overlap:
        raise StateError(
            f"the ranks' pieces of tensor {fqn!r} (shape {list(shape)}) do not tile it exactly "
            f"(boxes {[b.to_json() for b in boxes]}); Partial placements must be reduced first"
        )


def plan_arrays(
    per_rank: list[list[dict]],
    *,
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, ArrayPlan]:
    """Build the save plan from every rank's tensor descriptions (``describe_json`` dicts).

    Pure and deterministic: every rank computes the same plan from the same gathered input.
    """
    world_size = len(per_rank)
    by_fqn: dict[str, list[tuple[int, dict]]] = {}
    for rank, infos in enumerate(per_rank):
        for info in infos:
            by_fqn.setdefault(info["fqn"], []).append((rank, info))

    plans: dict[str, ArrayPlan] = {}
    single: list[tuple[ArrayPlan, Box, int]] = []
    shared: list[tuple[ArrayPlan, Box, list[int]]] = []
    for fqn in sorted(by_fqn):
        infos = by_fqn[fqn]
        _check_consistent(fqn, infos, world_size)
        # Placements and mesh from a rank that holds a piece (a placeholder has neither).
        first = next((info for _, info in infos if info["box"] is not None), infos[0][1])
        shape, dtype = tuple(first["shape"]), first["dtype"]
        holders: dict[Box, list[int]] = {}
        for rank, info in infos:
            if info["box"] is not None:
                holders.setdefault(Box.from_json(info["box"]), []).append(rank)
        boxes = sorted(holders, key=lambda b: b.offsets)
        _check_coverage(fqn, shape, boxes)
        item = itemsize(dtype)
        shard = choose_shard_shape(shape, boxes, [len(h) for h in holders.values()], item, max_shard_bytes)
        plan = ArrayPlan(
            fqn,
            shape,
            dtype,
            shard,
            choose_inner_shape(shard, item, inner_chunk_bytes),
            tuple(first["placements"]),
            tuple(first["mesh_shape"]),
            tuple(first["mesh_dim_names"]),
        )
        plans[fqn] = plan
        for box in boxes:
            ranks = sorted(holders[box])
            if len(ranks) == 1:
                single.append((plan, box, ranks[0]))
            else:
                parts = 1 if box.numel * item < MIN_SPLIT_BYTES else len(ranks)
                shared.extend((plan, part, ranks) for part in _split_rows(box, shard[0] if shard else 1, parts))

    _assign_writers(single, shared, world_size)
    for plan in plans.values():
        plan.regions.sort(key=lambda r: r.box.offsets)
    return plans


def _assign_writers(
    single: list[tuple[ArrayPlan, Box, int]], shared: list[tuple[ArrayPlan, Box, list[int]]], world_size: int
) -> None:
    """Mandatory work first, then replicated pieces largest-first to the least-loaded holder (LPT)."""
    load = [0] * world_size
    for plan, box, rank in single:
        plan.regions.append(Region(box, rank))
        load[rank] += box.numel * itemsize(plan.dtype)
    shared.sort(key=lambda t: (-t[1].numel * itemsize(t[0].dtype), t[0].fqn, t[1].offsets))
    for plan, box, ranks in shared:
        writer = min(ranks, key=lambda r: (load[r], r))
        plan.regions.append(Region(box, writer))
        load[writer] += box.numel * itemsize(plan.dtype)


def describe_json(local: LocalTensor) -> dict:
    """The JSON-able description of a LocalTensor that ranks exchange to build the plan."""
    return {
        "fqn": local.fqn,
        "shape": list(local.shape),
        "dtype": local.dtype,
        "box": local.box.to_json() if local.box is not None else None,
        "placements": list(local.placements),
        "mesh_shape": list(local.mesh_shape),
        "mesh_dim_names": list(local.mesh_dim_names),
    }


def plan_to_json(plan: ArrayPlan) -> dict:
    return {
        "fqn": plan.fqn,
        "shape": list(plan.shape),
        "dtype": plan.dtype,
        "shard_shape": list(plan.shard_shape),
        "inner_shape": list(plan.inner_shape),
        "placements": list(plan.placements),
        "mesh_shape": list(plan.mesh_shape),
        "mesh_dim_names": list(plan.mesh_dim_names),
        "regions": [{**r.box.to_json(), "writer": r.writer} for r in plan.regions],
    }


def plan_from_json(d: dict) -> ArrayPlan:
    return ArrayPlan(
        d["fqn"],
        tuple(d["shape"]),
        d["dtype"],
        tuple(d["shard_shape"]),
        tuple(d["inner_shape"]),
        tuple(d["placements"]),
        tuple(d["mesh_shape"]),
        tuple(d["mesh_dim_names"]),
        [Region(Box.from_json(r), r["writer"]) for r in d["regions"]],
    )
