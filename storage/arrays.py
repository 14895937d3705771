"""Zarr v3 arrays through TensorStore: specs, metadata documents, and error mapping.

Every array is ``sharding_indexed``: one outer chunk (shard) = one object, written whole by one
rank; inner chunks of a few MiB, each followed by a ``crc32c`` checksum, and a checksummed shard
index. Writers and readers open arrays with ``assume_metadata`` — the manifest already holds the
complete metadata, so no rank reads or races on ``zarr.json``; the coordinator writes those
documents once, for zarr-python and other readers.
"""

from __future__ import annotations

import re

from resilient.errors import IntegrityError, StorageError
from resilient.layout import ArrayPlan
from resilient.manifest import FORMAT_VERSION, ArrayEntry
from resilient.storage.objects import memory_context
from resilient.storage.pack import pack_name
from resilient.storage.url import Location

_CHECKSUMMED = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def _fill_value(dtype: str):
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    if dtype.startswith(("float", "bfloat")):
        return 0.0
    return 0


def chunk_key_encoding(format_version: int) -> dict:
    """How shard objects are named (``shardfile.chunk_key`` builds the same keys)."""
    if format_version >= 2:
        return {"name": "v2", "configuration": {"separator": "."}}
    return {"name": "default", "configuration": {"separator": "/"}}


def array_metadata(
    shape: list[int],
    dtype: str,
    shard_shape: list[int],
    inner_shape: list[int],
    *,
    format_version: int,
) -> dict:
    """The zarr v3 array metadata (without ``zarr_format``/``node_type``, as TensorStore takes it)."""
    return {
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard_shape)}},
        "chunk_key_encoding": chunk_key_encoding(format_version),
        "fill_value": _fill_value(dtype),
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner_shape),
                    "codecs": _CHECKSUMMED,
                    "index_codecs": _CHECKSUMMED,
                    "index_location": "end",
                },
            }
        ],
    }


def plan_metadata(plan: ArrayPlan) -> dict:
    """Metadata of an array this resilient writes (versions 2 and 3 have the same)."""
    return array_metadata(
        list(plan.shape), plan.dtype, list(plan.shard_shape), list(plan.inner_shape), format_version=FORMAT_VERSION
    )


def entry_metadata(entry: ArrayEntry) -> dict:
    """Metadata of an array a manifest names, in that manifest's format version."""
    return array_metadata(
        entry.shape, entry.dtype, entry.shard_shape, entry.inner_shape, format_version=entry.format_version
    )


def zarr_array_document(metadata: dict, attributes: dict) -> dict:
    """``zarr.json`` of an array, as zarr-python reads it."""
    return {"zarr_format": 3, "node_type": "array", **metadata, "attributes": attributes}


def zarr_group_document(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def kvstore_spec(location: Location, key: str, *, directory: bool = True) -> dict:
    """TensorStore kvstore spec of the directory ``key`` under the checkpoint root (of the object
    ``key`` when not ``directory``)."""
    path = location.join(key) + ("/" if directory else "")
    if location.scheme == "file":
        return {"driver": "file", "path": "/" + path}
    if location.scheme == "memory":
        return {"driver": "memory", "path": path}
    import os

    spec = {"driver": "s3", "bucket": location.bucket, "path": path, "aws_region": location.region}
    if location.endpoint:
        spec["endpoint"] = location.endpoint
    # The "default" chain floods stderr when ~/.aws is absent (ENV-NOTES); prefer the environment.
    has_env = "AWS_ACCESS_KEY_ID" in os.environ
    spec["aws_credentials"] = {"type": "environment" if has_env else "default"}
    return spec


def make_context(location: Location):
    """One TensorStore context per checkpointer: shared I/O concurrency limits, no chunk cache
    (checkpoints are written and read once; a cache would only hold a second copy in RAM)."""
    import tensorstore as ts

    if location.scheme == "memory":
        return memory_context(location.bucket)
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}})


def array_spec(location: Location, key: str, metadata: dict) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": kvstore_spec(location, key),
        "metadata": metadata,
        # A missing shard object must be an error, never silently read back as zeros...
        "fill_missing_data_reads": False,
        # ...so chunks equal to the fill value are written too, not skipped.
        "store_data_equal_to_fill_value": True,
    }


def open_array(location: Location, key: str, metadata: dict, context):
    """A future of the opened TensorStore (metadata assumed from the manifest, never read)."""
    import tensorstore as ts

    return ts.open(array_spec(location, key, metadata), context=context, open=True, create=True, assume_metadata=True)


def packed_kvstore_spec(location: Location, attempt_key: str, entry: ArrayEntry) -> dict:
    """The kvstore of a version 3 array: a ``kvstack`` that sends each of its keys to the ZIP pack
    holding it (TensorStore's ``zip`` kvstore over the pack object). An array whose shards all lie
    in one rank's first pack (its ``zarr.json`` is there too) is that pack's ``zip`` kvstore at the
    array's path, with no ``kvstack``."""

    def zipped(pack: str) -> dict:
        return {"driver": "zip", "base": kvstore_spec(location, f"{attempt_key}/{pack}", directory=False)}

    by_pack: dict[str, list[str]] = {}
    for key, (pack, _offset, _nbytes) in sorted(entry.shards.items()):
        by_pack.setdefault(pack, []).append(f"{entry.path}/{key}")
    # Rank 0's first pack holds every zarr.json, a rank's first pack those of the arrays it writes.
    docs = pack_name(0, 0)
    if len(by_pack) == 1 and next(iter(by_pack)).endswith("-0.zip"):
        docs = next(iter(by_pack))
    if len(by_pack) <= 1:
        only = next(iter(by_pack), docs)
        if only == docs:  # the whole array, zarr.json included, in one pack: that pack alone
            return {**zipped(only), "path": f"{entry.path}/"}
        layers = [
            {"prefix": f"{entry.path}/", "base": zipped(only), "strip_prefix": 0},
            {"exact": f"{entry.path}/zarr.json", "base": zipped(docs), "strip_prefix": 0},
        ]
    else:
        layers = [{"exact": f"{entry.path}/zarr.json", "base": zipped(docs), "strip_prefix": 0}]
        for pack, keys in by_pack.items():
            layers += [{"exact": key, "base": zipped(pack), "strip_prefix": 0} for key in keys]
    return {"driver": "kvstack", "layers": layers, "path": f"{entry.path}/"}


def reader_spec(location: Location, attempt_key: str, entry: ArrayEntry) -> dict:
    """What a plain TensorStore user opens a version 3 array with (it reads the array's zarr.json)."""
    return {"driver": "zarr3", "kvstore": packed_kvstore_spec(location, attempt_key, entry)}


def open_entry(location: Location, attempt_key: str, entry: ArrayEntry, context):
    """A future of the opened TensorStore of a manifest's array, in its format version (metadata
    assumed from the manifest, never read)."""
    import tensorstore as ts

    meta = entry_metadata(entry)
    if entry.format_version < 3:
        return open_array(location, f"{attempt_key}/{entry.path}", meta, context)
    spec = {**array_spec(location, "", meta), "kvstore": packed_kvstore_spec(location, attempt_key, entry)}
    return ts.open(spec, context=context, open=True, assume_metadata=True)


_ENTRY = re.compile(r'(?:chunk (\{[^}]*\}) stored at )?shard entry (\{[^}]*\})/\{[^}]*\} in (?:.*?)"([^"]+)"')


def read_error(err: Exception, *, fqn: str, step: int, url: str) -> Exception:
    """Map a TensorStore read failure to IntegrityError (corrupt or missing chunk) or StorageError."""
    msg = str(err)
    match = _ENTRY.search(msg)
    where = f"inner chunk {match.group(2)} of shard object {match.group(3)!r}" if match else "a chunk"
    if "DATA_LOSS" in msg or "Digest mismatch" in msg:
        return IntegrityError(
            f"checksum mismatch in tensor {fqn!r} at step {step}, {where} ({url}): the stored bytes "
            f"are corrupted. Load another step (load(state, step=...)) or restore from a replica. "
            f"[{msg}]"
        )
    if "ZIP" in msg:  # a pack (format version 3) whose archive structure is gone: cut short or overwritten
        return IntegrityError(
            f"tensor {fqn!r} at step {step} is damaged: the pack holding {where} ({url}) is not a whole "
            f"ZIP archive any more (cut short?). Load another step. [{msg}]"
        )
    if "NOT_FOUND" in msg or "is missing" in msg:
        return IntegrityError(
            f"tensor {fqn!r} at step {step} is missing data: {where} ({url}) does not exist. The "
            f"checkpoint is incomplete; load another step. [{msg}]"
        )
    return StorageError(f"reading tensor {fqn!r} at step {step} from {url} failed: {msg}")
