"""Is the checkpoint root the same place for every rank? Checked at start, in seconds.

A root that is a node-local path on several nodes (a ``run.dir`` under each pod's own disk) looks
fine to every rank alone: each writes its shards and receipts there. Then the first save waits for
receipts the coordinator can never see, for the whole commit timeout, and blames ranks that "may
have died". So before anything is saved, rank 0 writes a token under the root and every rank reads
it back; a rank that does not find it is on another filesystem, and every rank refuses the run at
once with one line that names the setting to change.
"""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any

from resilient.dist import agree
from resilient.errors import ConfigError
from resilient.storage.objects import ObjectStore

CHECK_PREFIX = "shared-check-"
"""Token objects are ``<root>/shared-check-<uuid>.json``, removed after the check (a listing of
steps ignores them: they are no step directory)."""


def check_shared_root(store: ObjectStore, *, setting: str, group: Any = None) -> None:
    """Collective over ``group``: raise the same ConfigError on every rank when some rank does not
    see what rank 0 wrote under ``store``'s root; ``setting`` names the key that chose the root (a
    setting to change, not a failure to retry: a restart would meet the same root)."""
    wrote = agree(lambda: _write_token(store), src=0, group=group, what="writing the shared-root token")
    key, url = wrote["key"], wrote["url"]  # rank 0's URL: the message must be the same on every rank
    expected = key.removeprefix(CHECK_PREFIX).removesuffix(".json")

    def _sees() -> dict[str, Any]:
        data = store.read(key)
        found = data is not None and json.loads(data).get("token") == expected
        return {"found": found, "host": socket.gethostname()}

    seen = agree(_sees, group=group, what="reading the shared-root token")
    agree(lambda: store.delete_prefix(key), src=0, group=group, what="removing the shared-root token")
    missing = [rank for rank, view in enumerate(seen) if not view["found"]]
    if missing:
        hosts = sorted({seen[rank]["host"] for rank in missing})
        raise ConfigError(
            f"{setting}={url} is not shared between the ranks: rank(s) {missing} on "
            f"{', '.join(hosts)} do not see the file rank 0 (on {seen[0]['host']}) wrote there, so no "
            f"save could ever commit; set {setting} to a directory every node mounts (a shared "
            "filesystem) or to an s3:// URL"
        )


def _write_token(store: ObjectStore) -> dict[str, str]:
    token = uuid.uuid4().hex
    key = f"{CHECK_PREFIX}{token}.json"
    store.write(key, json.dumps({"token": token}).encode())
    return {"key": key, "url": store.location.url}
