"""Open a checkpoint by URL for the offline tools; list its steps; summarize a manifest.

A URL names either a checkpoint root (``runs/x``, ``s3://b/run``) or one step directory in it
(``runs/x/step-000000100``). Everything here reads manifests and listings only, never tensor data.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field

from resilient.errors import ConfigError, IntegrityError, StorageError
from resilient.manifest import LATEST, MANIFEST, Manifest, parse_step_dir, step_dir
from resilient.storage.objects import ObjectStore, open_store
from resilient.storage.retention import StepListing, list_steps
from resilient.storage.url import Location, parse_url


@dataclass(slots=True)
class CheckpointRef:
    """One committed step of a checkpoint, opened for reading."""

    location: Location  # the checkpoint root
    store: ObjectStore
    step: int
    manifest: Manifest

    @property
    def attempt_key(self) -> str:
        return f"{step_dir(self.step)}/{self.manifest.attempt}"

    @property
    def url(self) -> str:
        return f"{self.location.url}/{step_dir(self.step)}"


def split_step_url(url: str) -> tuple[Location, int | None]:
    """(root, step) when ``url`` names a step directory, else (root, None)."""
    location = parse_url(url)
    head, _, name = location.prefix.rpartition("/")
    step = parse_step_dir(name)
    if step is None:
        return location, None
    return Location(location.scheme, location.bucket, head, location.endpoint, location.region, location.options), step


def open_root(url: str) -> tuple[Location, ObjectStore, int | None]:
    """The root's store (checked to exist) and the step the URL names, if any."""
    location, step = split_step_url(url)
    store = open_store(location)
    store.check_root(create=False)
    return location, store, step


def read_latest(store: ObjectStore) -> int | None:
    data = store.read(LATEST)
    if data is None:
        return None
    try:
        return int(json.loads(data)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def read_manifest(location: Location, store: ObjectStore, step: int) -> Manifest:
    key = f"{step_dir(step)}/{MANIFEST}"
    data = store.read(key)
    if data is None:
        raise ConfigError(f"step {step} is not committed under {location.url} (no {key}); see resilient-ckpt ls")
    try:
        return Manifest.loads(data, where=f"{location.url}/{key}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # Valid JSON that lacks a field (a hand edit, a foreign file) is as damaged as a truncated
        # one; without this it surfaced as "unexpected error: KeyError: 'arrays'".
        raise IntegrityError(
            f"manifest {location.url}/{key} is valid JSON but not a complete manifest "
            f"({type(e).__name__}: {e}); the step is damaged"
        ) from e


def open_checkpoint(url: str, step: int | None = None) -> CheckpointRef:
    """The committed step ``step`` (or the one the URL names, or the newest) of a checkpoint."""
    location, store, wanted, listing = _resolve(url, step)
    try:
        return CheckpointRef(location, store, wanted, read_manifest(location, store, wanted))
    except IntegrityError as e:
        raise IntegrityError(f"{e}; {_older_readable(location, store, listing, wanted)}") from e


def _older_readable(location: Location, store: ObjectStore, listing: StepListing, damaged: int) -> str:
    """What to use instead of a damaged step: the newest older step whose manifest reads."""
    for older in reversed([s for s in listing.committed if s < damaged]):
        if isinstance(_try_open(location, store, older), CheckpointRef):
            return f"the newest older step that reads is {older}: use it ({location.url}/{step_dir(older)})"
    return f"no older committed step reads either (resilient-ckpt ls {location.url} lists them)"


def _resolve(url: str, step: int | None) -> tuple[Location, ObjectStore, int, StepListing]:
    """Root, store and the committed step wanted (newest by default), without reading its manifest."""
    location, store, url_step = open_root(url)
    if url_step is not None and step is not None and url_step != step:
        raise ConfigError(f"{url} names step {url_step} but --step {step} was given; pass one of them")
    wanted = url_step if url_step is not None else step
    listing = list_steps(store)
    if not listing.committed and not listing.uncommitted:
        raise _not_a_checkpoint(location)
    if wanted is None:
        if not listing.committed:
            raise ConfigError(
                f"no committed step under {location.url} ({len(listing.uncommitted)} uncommitted: "
                f"{listing.uncommitted[-5:]}); a save never finished there"
            )
        wanted = listing.committed[-1]
    elif wanted not in listing.committed:
        raise ConfigError(
            f"step {wanted} is not committed under {location.url}; committed steps: {listing.committed[-10:] or 'none'}"
        )
    return location, store, wanted, listing


def _not_a_checkpoint(location: Location) -> StorageError:
    return StorageError(
        f"{location.url} is not a resilient checkpoint: no step-NNNNNNNNN directory in it; "
        "check the URL (a root such as runs/x or s3://bucket/run, or one of its step directories)"
    )


@dataclass(slots=True)
class DamagedStep:
    """A step that should be readable but is not: its manifest is unreadable, or gone."""

    step: int
    url: str
    kind: str  # "manifest" (unreadable) | "manifest-missing"
    message: str

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def _try_open(location: Location, store: ObjectStore, step: int) -> CheckpointRef | DamagedStep:
    url = f"{location.url}/{step_dir(step)}"
    try:
        return CheckpointRef(location, store, step, read_manifest(location, store, step))
    except IntegrityError as e:
        return DamagedStep(step, url, "manifest", f"step {step}: {e}")
    except ConfigError:
        # Listed as committed a moment ago, gone now (a prune racing us, a lost object).
        return DamagedStep(step, url, "manifest-missing", f"step {step}: {url}/{MANIFEST} disappeared after listing")


def open_step(url: str, step: int | None = None) -> CheckpointRef | DamagedStep:
    """Like ``open_checkpoint``, but a damaged manifest comes back as a DamagedStep, not raised."""
    location, store, wanted, _ = _resolve(url, step)
    return _try_open(location, store, wanted)


def open_every_step(url: str) -> list[CheckpointRef | DamagedStep]:
    """Every committed step of a root (or the one step a step URL names), ascending, each opened or
    reported damaged: one bad manifest must not hide the steps around it. A step that ``latest``
    names but that has no manifest is reported too: the commit writes the manifest before
    ``latest``, so that manifest was lost, not never written."""
    location, store, url_step = open_root(url)
    if url_step is not None:
        return [open_step(url)]
    listing = list_steps(store)
    if not listing.committed:
        _resolve(url, None)  # raises the error that says why nothing is committed
    opened = [_try_open(location, store, s) for s in listing.committed]
    latest = read_latest(store)
    if latest is not None and latest not in listing.committed:
        where = f"{location.url}/{step_dir(latest)}"
        state = "its directory holds no manifest" if latest in listing.uncommitted else "its directory is gone"
        opened.append(
            DamagedStep(
                latest,
                where,
                "manifest-missing",
                f"step {latest}: {location.url}/latest names it but {state}: a committed step was lost "
                "after its commit; the newest loadable step is an older one",
            )
        )
    return sorted(opened, key=lambda o: o.step)


def open_newest_readable(url: str, step: int | None = None) -> tuple[CheckpointRef | DamagedStep, list[DamagedStep]]:
    """The step asked for (damaged or not); for a root without ``step``, the newest committed step
    whose manifest reads, and the newer ones skipped because theirs does not."""
    location, store, wanted, listing = _resolve(url, step)
    if step is not None or split_step_url(url)[1] is not None:
        return _try_open(location, store, wanted), []
    skipped: list[DamagedStep] = []
    for s in reversed(listing.committed):
        opened = _try_open(location, store, s)
        if isinstance(opened, CheckpointRef):
            return opened, skipped
        skipped.append(opened)
    return skipped[0], skipped[1:]


def select(names: list[str], patterns: list[str] | None) -> list[str]:
    """Names matching any glob of ``patterns`` (all names when there is none)."""
    if not patterns:
        return list(names)
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def check_patterns_match(refs: list[CheckpointRef], patterns: list[str] | None) -> None:
    """ConfigError when ``--tensors`` globs match no tensor or value of any step read: a typo in a
    glob would otherwise verify (or diff) nothing and report the step OK."""
    names = sorted({n for r in refs for n in (*r.manifest.arrays, *r.manifest.values)})
    if patterns and refs and not select(names, patterns):
        raise ConfigError(
            f"--tensors {' '.join(patterns)} matches no tensor or value of {refs[0].url} "
            f"(it has e.g. {', '.join(names[:3])}); fix the glob, e.g. 'model.*'"
        )


# -- ls ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class StepInfo:
    step: int
    committed: bool
    attempt: str | None = None
    bytes: int = 0
    tensors: int = 0
    created_at: str | None = None
    orphan_attempts: list[str] = field(default_factory=list)
    problem: str | None = None

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def list_checkpoint(url: str) -> dict:
    """Every step directory under a root: committed steps with size, time, attempt; attempts that
    no manifest names (orphans of killed or failed saves); steps that were never committed."""
    location, store, _ = open_root(url)
    listing = list_steps(store)
    if not listing.committed and not listing.uncommitted:
        raise _not_a_checkpoint(location)
    steps = [_step_info(location, store, s, True) for s in listing.committed]
    steps += [_step_info(location, store, s, False) for s in listing.uncommitted]
    steps.sort(key=lambda s: s.step)
    latest = read_latest(store)
    notes = []
    if latest is not None and latest not in listing.committed:
        notes.append(f"latest names step {latest}, which is not committed")
    return {"root": location.url, "latest": latest, "steps": [s.to_json() for s in steps], "notes": notes}


def _step_info(location: Location, store: ObjectStore, step: int, committed: bool) -> StepInfo:
    attempts = [n for n in store.list_children(step_dir(step)) if n.startswith("attempt-")]
    info = StepInfo(step, committed)
    if not committed:
        info.orphan_attempts = attempts
        info.problem = "uncommitted: a save was killed, failed, or is still running"
        return info
    try:
        manifest = read_manifest(location, store, step)
    except (IntegrityError, ValueError) as e:
        info.problem = f"damaged manifest: {e}"
        return info
    info.attempt, info.bytes, info.tensors = manifest.attempt, manifest.total_bytes, len(manifest.arrays)
    info.created_at = manifest.to_json()["created_at"]
    info.orphan_attempts = [a for a in attempts if a != manifest.attempt]
    if manifest.attempt not in attempts:
        info.problem = f"the committed attempt {manifest.attempt} is missing"
    return info


# -- inspect ----------------------------------------------------------------------------------


def summarize(ref: CheckpointRef, patterns: list[str] | None = None) -> dict:
    """The manifest of one step as a JSON-able summary (tensors filtered by ``patterns``)."""
    m = ref.manifest
    meshes = sorted({(tuple(a.mesh_dim_names), tuple(a.mesh_shape)) for a in m.arrays.values() if a.mesh_shape})
    tensors = []
    for fqn in select(sorted(m.arrays), patterns):
        a = m.arrays[fqn]
        tensors.append(
            {
                "fqn": fqn,
                "shape": a.shape,
                "dtype": a.dtype,
                "bytes": a.nbytes,
                "shard_shape": a.shard_shape,
                "inner_shape": a.inner_shape,
                "regions": len(a.regions),
                "placements": a.placements,
                "mesh_shape": a.mesh_shape,
                "mesh_dim_names": a.mesh_dim_names,
            }
        )
    values = {k: m.values[k] for k in select(sorted(m.values), patterns)}
    return {
        "url": ref.url,
        "step": m.step,
        "format_version": m.format_version,
        "attempt": m.attempt,
        "created_at": m.to_json()["created_at"],
        "world_size": m.world_size,
        "total_bytes": m.total_bytes,
        "tensor_count": len(m.arrays),
        "versions": m.versions,
        "meshes": [{"dim_names": list(n), "shape": list(s)} for n, s in meshes],
        # The trainer's whole mesh (with its pp dim), which tensors' own meshes do not show: a
        # pipeline stage's parameters live on that stage's dp_shard x tp mesh.
        "save_mesh": m.metadata.get("mesh") if isinstance(m.metadata, dict) else None,
        "tensors": tensors,
        "values": values,
        "metadata": m.metadata,
    }
