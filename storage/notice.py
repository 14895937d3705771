"""A failed save's notice through the job's rendezvous store, beside the failure marker in storage.

A rank whose write fails tells the coordinator by a marker object under the attempt
(``commit.write_failure``), so the coordinator stops waiting for its receipt. When the failure IS
the storage refusing writes (a full disk, an exhausted quota), that marker cannot land either, and
the coordinator would wait out the whole commit timeout before blaming the rank for "dying". So
the notice also goes to the key-value store the ranks already share: torch's TCPStore at
``MASTER_ADDR:MASTER_PORT`` (the process group's own, under torchrun and in tests alike), which
needs no disk. A spawned writer process connects to it as a client too (it inherits the
environment). Best effort on both sides: without a reachable store, the marker alone decides.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
_PREFIX = "resilient/save-failed/"
RETRY_CONNECT_S = 60.0
"""After a failed connect, how long the notices go without a store before connecting again (the
store may have been restarting with the rendezvous; not every poll pays a connect timeout)."""
_lock = threading.Lock()
_client: dict[str, Any] = {"store": None, "retry_at": 0.0}
_decisions: list[str] = []
"""The decision notices this process posted and has not cleared (``clear_decisions``)."""


def _store() -> Any:
    with _lock:
        if _client["store"] is None and time.monotonic() >= _client["retry_at"]:
            _client["store"] = _connect()
            if _client["store"] is None:
                _client["retry_at"] = time.monotonic() + RETRY_CONNECT_S
        return _client["store"]


def _connect() -> Any:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT_S), wait_for_workers=False
        )
    except Exception as e:  # noqa: BLE001 - no store: the storage marker alone decides, as before
        log.warning("no rendezvous store for save failure notices (%s:%s): %s", host, port, e)
        return None


def _key(attempt_key: str, who: str) -> str:
    return f"{_PREFIX}{attempt_key}/{who}"


def post(attempt_key: str, who: str, record: dict[str, Any]) -> None:
    """Publish ``record`` as the notice ``who`` ("rank": some rank failed; "decision": the
    coordinator decided "not committed") of one attempt."""
    store = _store()
    if store is None:
        return
    try:
        store.set(_key(attempt_key, who), json.dumps(record))
        if who == "decision":
            _decisions.append(_key(attempt_key, who))
    except Exception as e:  # noqa: BLE001 - best effort: the storage marker is still tried
        log.warning("posting the failure notice of %s: %s", attempt_key, e)


def read(attempt_key: str, who: str) -> dict[str, Any] | None:
    """The notice ``who`` of one attempt, None when there is none (or no store to ask)."""
    store = _store()
    if store is None:
        return None
    key = _key(attempt_key, who)
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key))
    except Exception:  # noqa: BLE001 - unreadable is no notice: the storage poll goes on
        return None


def clear(attempt_key: str, who: str) -> None:
    """Delete the notice ``who`` of one attempt once it is decided: the store lives as long as the
    job, and a notice nobody reads again would stay in it."""
    _delete(_key(attempt_key, who))


def clear_decisions() -> None:
    """Delete the decision notices this process posted. The coordinator calls it once every rank's
    receipt of a later attempt is in: each rank's writer finished waiting for the earlier decision
    before it wrote that receipt (one save in flight per rank), so nobody reads them again."""
    while _decisions:
        _delete(_decisions.pop())


def _delete(key: str) -> None:
    if _client["store"] is None:
        return  # never connected: nothing was posted from here, nor read
    try:
        _client["store"].delete_key(key)
    except Exception as e:  # noqa: BLE001 - best effort: a stale notice names an attempt nobody polls
        log.debug("clearing the notice %s: %s", key, e)
