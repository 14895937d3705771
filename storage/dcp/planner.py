"""``SavePlanner`` / ``LoadPlanner``: DCP's default planners, with non-tensor values stored our way.

DCP's defaults ``torch.save`` every non-tensor value into bytes and ``torch.load`` them back, so
loading a checkpoint runs whatever pickle it holds. These subclasses keep everything else of the
defaults (flattening, dedup, resharding) and store a value as JSON (a tensor-free dict or list
whole, as our Checkpointer does, so it reads them too), ``bytes`` and ``io.BytesIO`` as raw
bytes, and refuse anything else at save time, naming the key: a load through them executes no
pickle at all.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem
from torch.distributed.checkpoint.utils import find_state_dict_object

from resilient.errors import StateError
from resilient.storage.dcp.values import StoredValue, decode, encode, group_values, like, value_at


class SavePlanner(DefaultSavePlanner):
    """Pass as ``planner=`` to ``dcp.save`` / ``dcp.async_save`` (with ``resilient.dcp.StorageWriter``)."""

    def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, mappings = flatten_state_dict(state_dict)
        tensors = {fqn for fqn, value in flat.items() if isinstance(value, torch.Tensor)}
        grouped = group_values(state_dict, mappings, tensors)
        entries: dict[str, Any] = {fqn: flat[fqn] for fqn in tensors}
        for fqn, path in grouped.items():
            # Encoded now: what we cannot store is refused here, on every rank, naming the key; and
            # a BytesIO is a leaf to DCP's flattening (a dict stored whole must not be walked into).
            entries[fqn] = encode(fqn, value_at(state_dict, path))
        # Keys are final FQNs already: the default flattening keeps them (a top-level key is one path
        # element); the real paths go back in for DCP's metadata (planner_data).
        super().set_up_planner(entries, storage_meta, is_coordinator)
        self.mappings = {**{fqn: mappings[fqn] for fqn in tensors}, **grouped}

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if isinstance(object, StoredValue):  # encoded in set_up_planner; DCP's default would pickle it
            return object
        return super().transform_object(write_item, object)


class LoadPlanner(DefaultLoadPlanner):
    """Pass as ``planner=`` to ``dcp.load`` (with ``resilient.dcp.StorageReader``): values come back
    from JSON or raw bytes; a pickled blob (saved with DCP's default planner) is refused."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if not isinstance(value, StoredValue):
            raise StateError(
                f"{fqn!r} came from a storage reader other than resilient.dcp.StorageReader; "
                "resilient.dcp.LoadPlanner reads values only through it (it never unpickles)"
            )
        decoded = decode(fqn, value.encoding, value.getvalue())
        if self.flatten_state_dict:
            path = self.mappings[fqn]
            parent = value_at(self.original_state_dict, path[:-1])
            parent[path[-1]] = like(parent[path[-1]], decoded)
        else:
            self.state_dict[fqn] = like(find_state_dict_object(self.state_dict, read_item.dest_index), decoded)
