"""What a DCP plugin opens to reach a root: its location, object store and TensorStore context.

Opened once per process and root, not per plugin: DCP users make a writer or reader per call
(torchtitan does), and an S3 client or a TensorStore context per call is setup a save or a load
would pay each time. Never pickled: a plugin sent to DCP's checkpoint process opens its own there.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from resilient.storage.arrays import make_context
from resilient.storage.objects import ObjectStore, open_store
from resilient.storage.url import Location, parse_url


@dataclass(frozen=True, slots=True)
class Runtime:
    location: Location
    store: ObjectStore
    context: Any  # TensorStore context (its I/O limits shared by the saves and loads of this root)


_OPENED: dict[tuple[str, str], Runtime] = {}
_LOCK = threading.Lock()


def runtime(url: str, storage_options: dict | None = None) -> Runtime:
    key = (url, json.dumps(storage_options or {}, sort_keys=True, default=str))
    with _LOCK:
        opened = _OPENED.get(key)
        if opened is None:
            location = parse_url(url, storage_options)
            opened = _OPENED[key] = Runtime(location, open_store(location), make_context(location))
        return opened
