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


# -- across replica groups ---------------------------------------------------------------------
#
# Groups share no process group, only the quorum: each group's rank 0 leaves a token under the
# root before the group first joins a quorum, and names in it the member id the quorum lists it
# by. A group that sees a member in its quorum reads that member's token: a member whose token it
# cannot find writes to another place. The check above already holds every rank of a group to its
# rank 0's root, so rank 0's view stands for its group.

GROUP_TOKEN = CHECK_PREFIX + "group{group}.json"
"""One token per group, overwritten by each of its starts (its member id changes with each)."""


def write_group_token(store: ObjectStore, group: int, *, member: str, job: str, secret: str) -> None:
    """Rank 0 of ``group``: the token its quorum peers read (``member``: its id in the quorum;
    ``job``: the job's identity; ``secret``: a fingerprint of the job secret, never the secret)."""
    record = {"member": member, "job": job, "secret": secret, "host": socket.gethostname()}
    store.write(GROUP_TOKEN.format(group=group), json.dumps(record).encode())


def remove_group_token(store: ObjectStore, group: int) -> None:
    store.delete_prefix(GROUP_TOKEN.format(group=group))


def check_group_tokens(
    store: ObjectStore, group: int, members: dict[int, tuple[str, bool]], *, job: str, secret: str
) -> None:
    """Rank 0 of ``group``: ConfigError unless every other member group of its quorum left its token
    under this root. ``members``: group -> (member id, proven: it showed it holds the job secret).
    A member that could not prove itself may be a stranger: only a token of this job that names
    another job secret is held against it (its run.dir made a job key of its own)."""
    unseen, other_secret, hosts = [], [], set()
    for other, (member, proven) in sorted(members.items()):
        data = store.read(GROUP_TOKEN.format(group=other))
        token = json.loads(data) if data is not None else {}
        # This job's token: the member's own, or (the same job) a newer start's of that group.
        ours = token.get("job") == job or (proven and token.get("member") == member)
        if proven and not ours:
            unseen.append(other)
        elif ours and token.get("secret") != secret:
            other_secret.append(other)
            hosts.add(token.get("host", "?"))
    if unseen:
        raise ConfigError(
            f"checkpoint.url={store.location.url} is not shared between the replica groups: group {group} (on "
            f"{socket.gethostname()}) does not see the file group(s) {unseen} wrote there, so they would commit "
            "steps it never sees; set checkpoint.url to a directory every node mounts (a shared filesystem) or "
            "to an s3:// URL"
        )
    if other_secret:
        raise ConfigError(
            f"replica group(s) {other_secret} (on {', '.join(sorted(hosts))}) hold another job secret than group "
            f"{group}: each made its own <run.dir>/job.key because run.dir is not shared between the nodes; set "
            "$RESILIENT_JOB_SECRET to the same value on every node, or run.dir to a directory every node mounts"
        )
