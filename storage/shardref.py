"""What a local read names when a shard is damaged: the shard (``ShardRef``: its tensor, step, key,
file and, in a pack, its range and the other tensors the pack holds) and the errors, in the words
of ``arrays.read_error`` (TensorStore's path), shared by the local readers (``localread``,
``packread``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from resilient.errors import IntegrityError, StorageError
from resilient.manifest import ArrayEntry


@dataclass(frozen=True, slots=True)
class ShardRef:
    """One shard object, with what an error message must name."""

    fqn: str
    step: int
    key: str  # "1.0" (format versions 2 and 3) or "c/1/0" (version 1)
    path: str  # the shard object (versions 1, 2) or the pack holding it (version 3)
    inner_shape: tuple[int, ...]
    dtype: np.dtype
    base: int = 0  # where the shard starts in the file
    nbytes: int | None = None  # the shard's length in its pack (version 3); None: the whole file
    held: tuple[str, ...] = ()  # version 3: the tensors of this load that the pack holds


def shard_ref(root: str, entry: ArrayEntry, key: str, step: int, dtype: np.dtype, held: dict) -> ShardRef:
    """The shard ``key`` of ``entry``: its own file (versions 1, 2) or its range of a pack (3)."""
    inner = tuple(entry.inner_shape)
    if entry.format_version < 3:
        return ShardRef(entry.fqn, step, key, f"{root}/{entry.path}/{key}", inner, dtype)
    ref = entry.shards.get(key)
    if ref is None:
        raise IntegrityError(
            f"tensor {entry.fqn!r} at step {step} is missing data: the manifest names no pack for shard "
            f"{key!r}. The checkpoint is damaged; load another step."
        )
    pack, base, nbytes = ref
    return ShardRef(entry.fqn, step, key, f"{root}/{pack}", inner, dtype, base, nbytes, held.get(pack, ()))


def chunk_where(shard: ShardRef, grid_index: tuple[int, ...]) -> str:
    return f"inner chunk {{{', '.join(str(i) for i in grid_index)}}} of shard object {shard.key!r}"


def corrupt(shard: ShardRef, where: str) -> IntegrityError:
    return IntegrityError(
        f"checksum mismatch in tensor {shard.fqn!r} at step {shard.step}, {where} ({shard.path}): the stored "
        f"bytes are corrupted. Load another step (load(state, step=...)) or restore from a replica."
    )


def damaged(shard: ShardRef, where: str, detail: str) -> IntegrityError:
    return IntegrityError(
        f"tensor {shard.fqn!r} at step {shard.step} is damaged: {where} ({shard.path}) {detail}{_held(shard)}. "
        f"Load another step (load(state, step=...)) or restore from a replica."
    )


def missing(shard: ShardRef, where: str, detail: str) -> IntegrityError:
    return IntegrityError(
        f"tensor {shard.fqn!r} at step {shard.step} is missing data: {where} ({shard.path}) {detail}{_held(shard)}. "
        f"The checkpoint is incomplete; load another step."
    )


def gone(shard: ShardRef) -> str:
    return "does not exist" if shard.nbytes is None else "is in a pack that does not exist"


def _held(shard: ShardRef) -> str:
    """What else the shard's pack takes with it (version 3), for a pack that is gone or cut."""
    if not shard.held:
        return ""
    shown = ", ".join(repr(f) for f in shard.held[:8])
    more = f" and {len(shard.held) - 8} more" if len(shard.held) > 8 else ""
    return f"; its pack holds tensors {shown}{more}"


def storage_error(shard: ShardRef, err: OSError) -> StorageError:
    return StorageError(f"reading tensor {shard.fqn!r} at step {shard.step} from {shard.path} failed: {err}")


def open_shard(shard: ShardRef) -> int:
    """A read-only descriptor of the file that holds ``shard``; a file that is gone is damage (an
    ``IntegrityError`` naming what it held), any other failure a ``StorageError``."""
    try:
        return os.open(shard.path, os.O_RDONLY)
    except FileNotFoundError as err:
        raise missing(shard, f"shard object {shard.key!r}", gone(shard)) from err
    except OSError as err:
        raise storage_error(shard, err) from err
