"""Offline retention: delete old committed steps and orphan attempts, with the library's rules.

Uses the same plan as the Checkpointer's retention (``plan_retention``) and adds the guards a
human running it by hand against a live job needs: never the newest committed step, never the
step ``latest`` names, never anything newer than ``latest`` (a save may be committing there right
now), and a dry run that lists exactly what would go.
"""

from __future__ import annotations

from resilient.errors import ConfigError, StorageError
from resilient.manifest import parse_step_dir
from resilient.storage.offline.catalog import open_root, read_latest
from resilient.storage.retention import KeepLast, delete_step_keys, list_steps, plan_retention


def _step_of(key: str) -> int:
    step = parse_step_dir(key.split("/", 1)[0])
    assert step is not None, key  # plan_retention only names step directories
    return step


def prune(url: str, keep_last: int, *, dry_run: bool = False) -> dict:
    """Delete (or with ``dry_run`` only list) what retention allows; returns what and what was kept."""
    if not isinstance(keep_last, int) or keep_last < 1:
        # Checked here, not left to KeepLast: its message names the API (keep_last=None), not the flag.
        raise ConfigError(f"--keep-last must be at least 1 (keep_last={keep_last} would delete every step)")
    location, store, url_step = open_root(url)
    if url_step is not None:
        raise ConfigError(f"prune takes a checkpoint root, not the step directory {url}")
    policy = KeepLast(keep_last)
    listing = list_steps(store)
    if not listing.committed and not listing.uncommitted:
        raise StorageError(f"{location.url} is not a resilient checkpoint: no step-NNNNNNNNN directory in it")
    latest = read_latest(store)
    newest = listing.committed[-1] if listing.committed else None
    guard = latest if latest is not None else newest
    doomed, spared, damaged = [], [], []
    for key in plan_retention(store, policy, damaged):
        step = _step_of(key)
        whole_step = "/" not in key
        if guard is not None and (step > guard or (whole_step and step == guard)):
            spared.append(key)
        else:
            doomed.append(key)
    if not dry_run:
        delete_step_keys(store, doomed)
    kept = [s for s in listing.committed if s not in {_step_of(k) for k in doomed if "/" not in k}]
    return {
        "root": location.url,
        "keep_last": keep_last,
        "dry_run": dry_run,
        "latest": latest,
        "planned": doomed,
        "deleted": [] if dry_run else doomed,
        "spared": spared,
        "kept_committed": kept,
        "damaged": damaged,  # kept steps whose manifest is unreadable: their orphans were left alone
    }
