"""Which steps exist, which are committed, and what retention may delete.

A step is committed iff its ``manifest.json`` exists. Everything else under a step directory that
the manifest does not name — attempts of killed or failed saves — is an orphan. Retention runs
only after a newer commit, deletes a step's manifest before its data (so a half-deleted step is
simply uncommitted), and never touches the newest committed step or anything newer than it.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from resilient.errors import ConfigError
from resilient.manifest import LATEST, MANIFEST, parse_step_dir, step_dir
from resilient.storage.objects import ObjectStore
from resilient.storage.retention_cache import CheckedSteps, forget_step, manifest_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KeepLast:
    """Keep the ``n`` newest committed steps (None: keep every step)."""

    n: int | None = None

    def __post_init__(self) -> None:
        if self.n is not None and (not isinstance(self.n, int) or self.n < 1):
            raise ConfigError(f"keep_last must be a positive integer or None, got {self.n!r}")


@dataclass(slots=True)
class StepListing:
    committed: list[int] = field(default_factory=list)
    uncommitted: list[int] = field(default_factory=list)  # a step dir with no manifest
    presumed: set[int] = field(default_factory=set)  # taken as committed from ``known``, not asked


def list_steps(store: ObjectStore, known: CheckedSteps | None = None) -> StepListing:
    """The step directories under the root, committed or not (a manifest each, asked of the store
    except for the steps ``known`` checked before: retention reads or verifies those itself)."""
    listing = StepListing()
    for name in store.list_children(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        if known is not None and known.presumes_committed(step):
            listing.presumed.add(step)
            listing.committed.append(step)
            continue
        (listing.committed if store.exists(f"{name}/{MANIFEST}") else listing.uncommitted).append(step)
    listing.committed.sort()
    listing.uncommitted.sort()
    return listing


class DamagedManifest(Exception):
    """A step's manifest.json exists but cannot be read as a manifest (truncated, not JSON)."""


_ATTEMPT_OF: dict[tuple[str, int, bytes], str] = {}
"""Attempt named by manifest bytes already parsed, by (root, step, BLAKE2b of those bytes): a
committed manifest never changes, and a commit re-reads the manifests ``keep_last`` counts and
those of steps not yet settled (``retention_cache``), whose ``json.loads`` was a visible share of
a many-tensor save (benchmarks/README.md, "Choices in the code"). Bytes that differ (damaged,
rewritten) miss; a cryptographic digest, not a crc, so no crafted or chance collision names
another attempt."""
_ATTEMPT_CACHE_MAX = 1024


def _attempt_key(store: ObjectStore, step: int, data: bytes) -> tuple[str, int, bytes]:
    return (store.location.url, step, manifest_digest(data))


def _remember(key: tuple[str, int, bytes], attempt: str) -> None:
    if len(_ATTEMPT_OF) >= _ATTEMPT_CACHE_MAX:
        _ATTEMPT_OF.clear()
    _ATTEMPT_OF[key] = attempt


def remember_committed(store: ObjectStore, step: int, data: bytes, attempt: str) -> None:
    """The coordinator just wrote these manifest bytes: the retention that follows its commit needs
    not parse them back (parsing the kept manifests showed up in the writer's profile of a 1 GiB,
    4-rank save; benchmarks/README.md, "Choices in the code")."""
    _remember(_attempt_key(store, step, data), attempt)


def committed_attempt(store: ObjectStore, step: int) -> str | None:
    """The attempt the step's manifest names (None: no manifest); DamagedManifest if unreadable."""
    data = store.read(f"{step_dir(step)}/{MANIFEST}")
    return None if data is None else _attempt_of(store, step, data)


def _attempt_of(store: ObjectStore, step: int, data: bytes) -> str:
    key = _attempt_key(store, step, data)
    cached = _ATTEMPT_OF.get(key)
    if cached is not None:
        return cached
    attempt = _parse_attempt(data, f"{store.location.url}/{step_dir(step)}/{MANIFEST}")
    _remember(key, attempt)
    return attempt


def _parse_attempt(data: bytes, where: str) -> str:
    """The attempt named by manifest bytes; DamagedManifest if they do not name one."""
    try:
        attempt = json.loads(data)["attempt"]
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedManifest(f"{where}: {e}") from e
    if not isinstance(attempt, str):
        raise DamagedManifest(f"{where}: attempt is {attempt!r}")
    return attempt


def new_attempt() -> str:
    """A fresh attempt name, ``attempt-<creation ms, hex>-<random>``: its age can be read back
    (``attempt_age_s``) without a request per object."""
    return f"attempt-{int(time.time() * 1000):011x}-{secrets.token_hex(4)}"


def attempt_age_s(name: str, now: float | None = None) -> float | None:
    """How long ago attempt ``name`` was created (None: a name without its time, an older format)."""
    parts = name.split("-")
    if len(parts) != 3 or len(parts[1]) != 11:
        return None
    try:
        return (time.time() if now is None else now) - int(parts[1], 16) / 1000
    except ValueError:
        return None


def _in_flight(name: str, young_s: float) -> bool:
    """Whether attempt ``name`` may still be another writer's save in progress (two replica groups
    both persisting a restored step): younger than ``young_s``. Deleting it would fail that save."""
    age = attempt_age_s(name)
    return young_s > 0 and age is not None and age < young_s


def plan_retention(
    store: ObjectStore,
    policy: KeepLast,
    damaged: list[int] | None = None,
    *,
    young_s: float = 0.0,
    known: CheckedSteps | None = None,
) -> list[str]:
    """Keys (relative to the root) that retention would delete: whole steps oldest first, then
    the stray attempts of kept steps.

    ``keep_last`` counts steps that load: a step whose manifest is damaged is kept but not counted
    (its step number goes to ``damaged``), so damaged steps never crowd out the good steps a
    restore falls back to, and one bad old step never makes retention (and with it every later
    commit) fail. Which attempt of a damaged step is real cannot be known: its attempts stay.
    Attempts younger than ``young_s`` that no manifest names (another writer's save in flight)
    stay too, and so does an uncommitted step that holds one. ``known``: what earlier passes of
    this process found, to skip the steps they settled (``retention_cache``); it never adds a key."""
    listing = list_steps(store, known)
    if known is not None:
        known.begin_pass(listing.committed + listing.uncommitted)
    # The newest step committed now: an uncommitted step above it may be a save in flight. Not a
    # step taken from ``known`` unasked (another process may have set it aside since).
    newest = next((s for s in reversed(listing.committed) if _committed_now(store, s, listing, known)), None)
    if newest is None:
        return []
    doomed: list[str] = []
    good = 0
    for step in reversed(listing.committed):  # the newest is always kept
        if policy.n is not None and good >= policy.n:
            if _committed_now(store, step, listing, known):
                doomed.append(step_dir(step))
            continue
        if known is not None and policy.n is None and known.skips(step):
            continue  # settled, and nothing to count: looked at again in its turn
        try:
            strays = _committed_strays(store, step, young_s, known)
        except DamagedManifest as e:
            log.warning("retention skips step %d, its manifest is damaged (%s); run resilient-ckpt verify", step, e)
            if damaged is not None:
                damaged.append(step)
            continue
        if strays is None:  # the manifest went away after listing (set aside): not a step that loads
            continue
        good += 1
        doomed += strays
    kept = [step for step in listing.committed if step_dir(step) not in doomed]
    doomed += _uncommitted_doomed(store, listing, newest, kept[0], young_s)
    return sorted(doomed, key=_step_of_key)


def _committed_now(store: ObjectStore, step: int, listing: StepListing, known: CheckedSteps | None) -> bool:
    """Whether a step about to be deleted as committed is: one the listing took from ``known`` is
    asked first (its manifest may have been moved away since; it is then left for the next pass)."""
    if step not in listing.presumed:
        return True
    if store.exists(f"{step_dir(step)}/{MANIFEST}"):
        return True
    if known is not None:
        known.forget(step)
    return False


def _committed_strays(store: ObjectStore, step: int, young_s: float, known: CheckedSteps | None) -> list[str] | None:
    """The stray attempts of committed ``step`` to delete (None: its manifest is gone now);
    DamagedManifest if the manifest is unreadable. A step ``known`` settled with these very
    manifest bytes is not listed again."""
    data = store.read(f"{step_dir(step)}/{MANIFEST}")
    if data is None:
        if known is not None:
            known.forget(step)
        return None
    digest = manifest_digest(data)
    if known is not None and known.settled_for(step, digest):
        return []
    keep = {_attempt_of(store, step, data), _set_aside_attempt(store, step)}  # a damaged step's data stays
    attempts = [n for n in store.list_children(step_dir(step)) if n.startswith("attempt-") and n not in keep]
    strays = [name for name in attempts if not _in_flight(name, young_s)]
    if known is not None:  # settled once the strays are gone, unless another writer's save is in flight
        known.stage(step, digest, settled=len(strays) == len(attempts))
    return [f"{step_dir(step)}/{name}" for name in strays]


def _uncommitted_doomed(
    store: ObjectStore, listing: StepListing, newest: int, oldest_kept: int, young_s: float
) -> list[str]:
    doomed: list[str] = []
    for step in listing.uncommitted:
        if step >= newest:
            continue  # a newer uncommitted step may be a save still in flight
        aside = _set_aside_attempt(store, step)
        if aside is not None and step > oldest_kept:
            continue  # set aside by a restore that fell back past it: kept for inspection, as a step is
        names = [n for n in store.list_children(step_dir(step)) if n != aside] if young_s > 0 else []
        if any(_in_flight(name, young_s) for name in names):
            stale = [n for n in names if n.startswith("attempt-") and not _in_flight(n, young_s)]
            stale += [aside] if aside is not None else []
            doomed += [f"{step_dir(step)}/{n}" for n in stale]
        else:
            doomed.append(step_dir(step))
    return doomed


def _set_aside_attempt(store: ObjectStore, step: int) -> str | None:
    data = store.read(f"{step_dir(step)}/{SET_ASIDE_MANIFEST}")
    try:
        return json.loads(data)["attempt"] if data is not None else None
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: its attempt cannot be told apart (deleted with the strays)


def _step_of_key(key: str) -> tuple[bool, int, str]:
    return "/" in key, int(key.split("/", 1)[0].removeprefix("step-")), key


SET_ASIDE_MANIFEST = "manifest.damaged.json"
"""Where a damaged step's manifest goes when a restore falls back past it (kept for inspection)."""


def set_aside(store: ObjectStore, step: int, damaged: bytes) -> bool:
    """Make committed ``step`` uncommitted by moving its manifest to ``SET_ASIDE_MANIFEST``: a
    restore fell back past it as damaged, and the run will save that step number again (a committed
    step is never overwritten). Only while the manifest still holds ``damaged``, the bytes read when
    the step failed to load: another replica group may have committed the step afresh since. The copy
    is written before the manifest is deleted; retention keeps the attempt it names. False: not set
    aside (the manifest changed or is gone)."""
    key, copy = f"{step_dir(step)}/{MANIFEST}", f"{step_dir(step)}/{SET_ASIDE_MANIFEST}"
    if store.read(key) != damaged:
        return False
    store.write(copy, damaged)
    # Compared again right before the delete: a fresh commit that landed while the copy was written
    # is kept. A window remains between this read and the delete, one storage request long (a
    # local stat, an S3 round trip), that only a conditional delete would close.
    if store.read(key) != damaged:
        store.delete_prefix(copy)  # the step is committed afresh: nothing set aside
        return False
    store.delete_prefix(key)
    forget_step(store.location.url, step)
    _point_latest_below(store, step)
    return True


def _point_latest_below(store: ObjectStore, step: int) -> None:
    """``latest`` only ever moves up, except here: it must not keep naming a step that is no longer
    committed (tools would report that step as lost after its commit)."""
    try:
        named = json.loads(store.read(LATEST) or b"{}").get("step")
    except (ValueError, AttributeError):
        return
    if named != step:
        return
    below = [s for s in list_steps(store).committed if s < step]
    if below:
        store.write(LATEST, json.dumps({"step": below[-1]}).encode())
    else:
        store.delete_prefix(LATEST)


def delete_step_keys(store: ObjectStore, keys: list[str]) -> None:
    for key in keys:
        if "/" not in key:  # a whole step: drop the commit marker first
            store.delete_prefix(f"{key}/{MANIFEST}")
        store.delete_prefix(key)
        log.info("retention deleted %s/%s", store.location.url, key)


def apply_retention(
    store: ObjectStore, policy: KeepLast, *, young_s: float = 0.0, known: CheckedSteps | None = None
) -> list[str]:
    """Plan and delete; ``known`` (the committing process's, ``retention_cache.checked_steps``)
    lets a pass skip the committed steps earlier passes settled, so a commit's retention costs a
    bounded number of requests however many steps are kept."""
    # Another pass of this process on this root holds ``known``: look at every step, as without it.
    if known is None or not known.lock.acquire(blocking=False):
        doomed = plan_retention(store, policy, young_s=young_s)
        delete_step_keys(store, doomed)
        return doomed
    try:
        doomed = plan_retention(store, policy, young_s=young_s, known=known)
        delete_step_keys(store, doomed)
        known.confirm({_step_of_key(key)[1] for key in doomed if "/" not in key})
    finally:
        known.lock.release()
    return doomed
