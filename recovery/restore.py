"""The one restore policy: where a (re)started group's state comes from.

Top to bottom, the first tier that has the state wins:

1. ``peer``        a live replica group healed this one inside the first torchft quorum (torchft
                   did the transfer; the policy records it and reads nothing);
2. ``own``         the RAM tier's newest step every rank of the group can get, if it is not older
3. ``buddy``       than the newest committed persistent step: each rank's own snapshot, else its
                   buddy node's copy (``resilient.recovery.ram.restore``); only snapshots of this
                   run's current timeline (``resilient.recovery.timeline``);
4. ``persistent``  the newest committed checkpoint that loads, on any mesh;
5. ``fresh``       nothing to restore: step 0.

``checkpoint.load_step`` sends the run back to one committed step: RAM snapshots of later steps
are not used, and it must load (a damaged chosen step is an error, not a silent other step). No
committed step may come after it (training on would save that step number again, and a committed
step is never overwritten). It applies once: the timeline it begins records it, and a restart
with the same recipe goes on in that timeline instead of rewinding again.

Damaged steps: when the newest committed step does not load on some rank (an ``IntegrityError``:
checksum mismatch, a damaged manifest, a missing chunk), every rank learns it through one
collective. First the tensor it names is re-read, every crc32c checked, on another rank
(``restore_recheck`` event): intact there, the step is loaded once more (a bad read on one node
must not set a good step aside for everyone; failing again, it is that node's fault, raised). Else
the group falls back to the next older committed step, recording ``restore_fallback`` in
``events.jsonl``; an older step's strict load writes every tensor and value
of the state again, so what the failed attempt wrote is overwritten. Once an older state has loaded,
the damaged steps passed are set aside (their manifest renamed), because the run saves those step
numbers again. Any other error (storage
unreachable, a state that does not match) is raised on every rank: an older step would not help.

Timelines: every restore starts a new timeline of the run (``recovery.timeline``). One that does not come
from RAM (persistent, fresh, ``checkpoint.resume`` off, a peer heal: the live group may have rewound
since this group's snapshots were taken) keeps no RAM snapshot of the history it left eligible. A
RAM restore to step S branches: the parent's snapshots up to S stay eligible, none after S (a node
absent during the restore still holds them).

A RAM restore puts each snapshot straight into the state as it checks it when whatever lands
there of a step not restored after all is overwritten: by the persistent step behind it, or, with
none, by the caller's ``reinit`` (the initial state put back on every rank together). Without
either (a caller that cannot rebuild its initial state), the snapshots are checked in fresh memory
and copied only once every rank has its own (``resilient.recovery.ram.restore``).

The group decides together before any rank loads, and falls back together (the model is Orbax's
emergency checkpoint manager: decide globally, try the fast tier, fall back through one collective):
rank 0 lists the committed steps and every rank gets the same list or the same error
(``dist.agree``); the RAM decision is one collective over the group; the persistent load agrees on
its manifest inside the Checkpointer.

Storage errors: a root that does not exist yet (a local directory, an empty memory store) is a
fresh start; a missing bucket or an unreachable endpoint is an error (starting afresh there would
silently drop a run's progress), raised on every rank, unless the RAM tier restores the run.

Every rank writes one ``restore`` event to ``<run.dir>/events.jsonl`` (group, rank, step, source,
bytes, seconds, storage_reads, excluded, run_id, timeline_incarnation, timeline), except when
``checkpoint.resume`` is off.
"""

from __future__ import annotations

import functools
import glob
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilient import dist as rdist
from resilient.errors import ConfigError, IntegrityError, ResilientError, RestoreError, StorageError
from resilient.manifest import MANIFEST, step_dir
from resilient.recovery import timeline as timelines
from resilient.recovery.ram import RamTier
from resilient.recovery.timeline import Timeline
from resilient.runfiles import group_id, write_event
from resilient.storage.checkpointer import Checkpointer
from resilient.storage.offline.catalog import open_checkpoint
from resilient.storage.offline.verify import verify_step
from resilient.storage.retention import SET_ASIDE_MANIFEST, set_aside

log = logging.getLogger(__name__)

SOURCES = ("own", "buddy", "persistent", "peer", "fresh")
"""Where a restored state came from: the one vocabulary of events, chaos scenarios and tools (the
policy tries peer first, then own and buddy RAM, then persistent)."""

_RAM_WHERE = {"own": "this node's RAM", "buddy": "the buddy node's RAM"}


@dataclass(frozen=True, slots=True)
class PeerHeal:
    """A heal from a live replica group, already applied inside the first torchft quorum."""

    step: int
    bytes: int
    seconds: float


@dataclass(slots=True)
class RestoreResult:
    """What this rank restored: the fields of its ``restore`` event, and the state it loaded."""

    step: int
    """The step training continues from (0: fresh)."""
    source: str
    """One of ``SOURCES``."""
    bytes: int = 0
    """Bytes this rank loaded (RAM snapshot, checkpoint reads or heal transfer)."""
    seconds: float = 0.0
    storage_reads: int = 0
    """Objects this rank read from persistent storage (0 for a RAM or peer restore)."""
    excluded: list[dict[str, Any]] = field(default_factory=list)
    """RAM snapshots the decision skipped: ``{"step", "source", "reason"}`` each."""
    timeline: Timeline | None = None
    """The run and timeline training goes on in (what new RAM snapshots are tagged with)."""
    group_sources: list[str] = field(default_factory=list)
    """After a RAM restore: every rank's source ("own" or "buddy"), by rank; the line a run prints
    names the mix, not rank 0's source alone."""
    snapshot_timeline: str = ""
    """After a RAM restore: the timeline of the snapshot this rank restored (an ancestor of ``timeline``)."""

    @property
    def loaded(self) -> bool:
        """Whether this call loaded a step into the state (RAM or persistent; a heal is torchft's)."""
        return self.source in ("own", "buddy", "persistent")


def restore(
    target: Callable[[], dict[str, Any]],
    apply: Callable[[dict[str, Any]], None],
    *,
    checkpointer: Checkpointer,
    ram: RamTier | None,
    run_dir: str,
    peer: PeerHeal | None = None,
    resume: bool = True,
    say: Callable[[str], None] | None = None,
    layout: str = "",
    load_step: int | None = None,
    reinit: Callable[[], None] | None = None,
) -> RestoreResult:
    """Collective over the group: decide where this group's state comes from and load it.

    ``target()`` builds the state dict to load into (called only when a tier is tried: building it
    can initialize the optimizer's state); ``apply(state)`` puts a loaded state in place (its time
    counts in ``seconds``); ``peer``: the heal of the first quorum, if there was one; ``resume``:
    ``checkpoint.resume`` (off: a fresh start, no event); ``say``: where the one-line outcome goes
    ("resumed from step N of ... on <layout> in X s"); ``load_step``: ``checkpoint.load_step``, a
    committed step to resume from instead of the newest (ConfigError on every rank if it is not one);
    ``reinit``: puts the initial (step-0) state back into the tensors ``target``'s state shares, in
    place; called, inside one agreement over the group, on each rank a RAM restore wrote into when
    no step was restored after all. Given, a RAM restore with no persistent step behind it puts
    each snapshot straight into the state (``ram.inplace``); without it, fresh memory first.
    """
    if peer is not None:
        result = RestoreResult(peer.step, "peer", peer.bytes, peer.seconds)
        # A heal is a restore not from RAM: a new timeline (``timelines.healed``), without storage
        # when the RAM tier is off (nothing is tagged with it then).
        heal = functools.partial(timelines.healed, load_step=load_step, storage=ram is not None, step=peer.step)
        result.timeline = _shared_timeline(heal, checkpointer, run_dir, ram)
    elif not resume:
        # A fresh start leaves whatever RAM holds behind for good, as a persistent restore does.
        fresh = RestoreResult(0, "fresh")
        fresh.timeline = _shared_timeline(timelines.start, checkpointer, run_dir, ram)
        return fresh
    else:
        result = _from_tiers(target(), apply, checkpointer, ram, run_dir, load_step, reinit)
    assert result.timeline is not None
    write_event(
        run_dir,
        "restore",
        group=group_id(),
        rank=rdist.get_rank(),
        step=result.step,
        source=result.source,
        bytes=result.bytes,
        seconds=round(result.seconds, 6),
        storage_reads=result.storage_reads,
        excluded=result.excluded,
        run_id=result.timeline.run_id,
        timeline_incarnation=result.timeline.incarnation,
        timeline=result.timeline.timeline,
        **_branch_fields(result),
    )
    if say is not None and result.source != "peer":
        say(describe(result, checkpointer.url, layout))
    return result


def _from_tiers(
    state: dict[str, Any],
    apply: Callable[[dict[str, Any]], None],
    checkpointer: Checkpointer,
    ram: RamTier | None,
    run_dir: str,
    load_step: int | None,
    reinit: Callable[[], None] | None = None,
) -> RestoreResult:
    """Own RAM, buddy RAM, persistent, fresh: the RAM tier's step wins when it is not older."""
    start = time.perf_counter()
    steps, listing_error = _committed_or_error(checkpointer, ram_may_restore=ram is not None)
    # Rank 0 reads the run's identity and timeline for everyone: which RAM snapshots may restore,
    # and whether checkpoint.load_step was applied already.
    records = rdist.agree(ram.node_record, what="RAM timeline records") if ram is not None else []
    current = _shared_timeline(functools.partial(timelines.current, records=records), checkpointer, run_dir, ram)
    rewind = _rewind_to(load_step, current, steps, listing_error, checkpointer.url)
    persistent = rewind if rewind is not None else (steps[-1] if steps else None)
    reads_before = checkpointer.storage_reads
    result = RestoreResult(0, "fresh", timeline=current)
    touched = False
    if ram is not None:
        # In place only if what lands of a step not restored after all is overwritten: by the
        # persistent load the policy falls back to, or by the caller's initial state (``reinit``).
        in_place = persistent is not None or reinit is not None
        fast = ram.restore(state, persistent, newest=rewind, in_place=in_place)
        result.excluded, touched = fast.excluded, fast.touched
        if fast.step is not None and fast.source is not None:
            result.step, result.source, result.bytes = fast.step, fast.source, fast.bytes
            result.group_sources = fast.sources
            result.snapshot_timeline = fast.snapshot_timeline
    if not result.loaded and listing_error is not None:
        raise listing_error  # on every rank: each got the same error, and the RAM decision is collective
    if not result.loaded and persistent is None and ram is not None and reinit is not None:
        # A fresh start after a RAM decision that may have written in place: if any rank's tensors
        # took bytes of a step not restored, every rank puts the initial state back, and a rank
        # whose reinit fails raises with the others.
        _put_back_initial(reinit, touched)
    if not result.loaded and persistent is not None:
        if rewind is not None:  # the step asked for, or an error: never another step in its place
            _load_committed(result, state, checkpointer, rewind)
        else:
            _from_persistent(result, state, checkpointer, steps[::-1], run_dir, ram)
    if result.source not in ("own", "buddy") or rewind is not None:
        # Not from RAM, or back to a chosen step: every snapshot taken so far belongs to a history
        # the run left. A new timeline, recorded before training goes on.
        begin = functools.partial(timelines.start, load_step=load_step, step=result.step)
        result.timeline = _shared_timeline(begin, checkpointer, run_dir, ram)
    else:
        # From RAM: a branch at the restored step. Snapshots after it, on a node absent now, must
        # never restore later beside the steps retrained here (``recovery.timeline``).
        branch = functools.partial(timelines.branch, parent=current, step=result.step)
        result.timeline = _shared_timeline(branch, checkpointer, run_dir, ram)
    if result.loaded:
        apply(state)
    result.seconds = time.perf_counter() - start
    result.storage_reads = checkpointer.storage_reads - reads_before
    return result


def _put_back_initial(reinit: Callable[[], None], touched: bool) -> None:
    """Collective: when a RAM decision wrote into any rank's state (``touched`` may differ across
    ranks), ``reinit`` on every rank: its model build may run collectives (tensor parallelism
    broadcasts), so a rank whose reinit fails before one leaves its peers waiting in it until the
    process group's timeout, as a failed build at start does; after, every rank raises its error."""
    if not any(rdist.agree(lambda: touched, what="whether a RAM restore wrote into the state")):
        return

    def put_back() -> None:
        log.warning("[rank %d] no RAM step restored: putting the initial state back", rdist.get_rank())
        reinit()

    rdist.agree(put_back, what="putting the initial state back after a RAM restore that did not complete")


def _branch_fields(result: RestoreResult) -> dict[str, Any]:
    """A RAM restore's event names the timeline of the snapshot it took and the ancestors the new
    timeline keeps eligible, so a check can tell that it came from the current branch."""
    if result.source not in ("own", "buddy") or result.timeline is None:
        return {}
    return {"snapshot_timeline": result.snapshot_timeline, "ancestors": [list(a) for a in result.timeline.ancestors]}


def _shared_timeline(
    fn: Callable[[Any, str, int], Timeline], checkpointer: Checkpointer, run_dir: str, ram: RamTier | None
) -> Timeline:
    """``fn`` (a ``timelines`` function) on rank 0, its timeline on every rank (or the same error);
    set as ``ram``'s timeline when given."""
    raw = rdist.agree(lambda: fn(checkpointer.store, run_dir, group_id()).to_json(), src=0, what="run timeline")
    timeline = Timeline.from_json(raw)
    assert timeline is not None
    if ram is not None:
        ram.timeline = timeline
    return timeline


def _rewind_to(
    load_step: int | None, current: Timeline, steps: list[int], listing_error: StorageError | None, url: str
) -> int | None:
    """The committed step ``checkpoint.load_step`` sends the run back to now, or None: unset, or
    applied already (the current timeline began with it: a restart of the rewound run, with the
    same recipe, goes on instead of rewinding again). Same outcome on every rank: the arguments
    are agreed."""
    if load_step is None or current.load_step == load_step:
        return None
    if listing_error is not None:
        raise listing_error  # the chosen step can only come from storage
    if load_step not in steps:
        shown = ", ".join(map(str, steps[-20:])) or "none"
        raise ConfigError(
            f"checkpoint.load_step={load_step} is not a committed step under {url}; committed steps: {shown} "
            f"(pick one of them, or unset checkpoint.load_step to resume from the newest)"
        )
    later = [step for step in steps if step > load_step]
    if later:
        # Training on would save these step numbers again, and a committed step is never
        # overwritten: fail now, not at that save. Deleting them is the user's call.
        raise ConfigError(
            f"checkpoint.load_step={load_step}: committed step(s) {', '.join(map(str, later))} under {url} come "
            f"after it and would be saved again; delete them first (each step's manifest.json, then its "
            f"directory), or unset checkpoint.load_step"
        )
    return load_step


def _from_persistent(
    result: RestoreResult,
    state: dict[str, Any],
    checkpointer: Checkpointer,
    candidates: list[int],
    run_dir: str,
    ram: RamTier | None,
) -> None:
    """Load the first of ``candidates`` (committed steps, newest first) that loads on every rank.

    A damaged step (IntegrityError: checksum mismatch, damaged manifest, missing chunk) on any
    rank moves every rank on together: ``agree`` gives each rank the first failing rank's error.
    Past a damaged step, a RAM snapshot of the current timeline older than it but newer than the
    next committed step is the newest state left, so the RAM decision is taken again with its
    lower bound moved down. Any other error is raised on every rank."""
    damaged: list[str] = []
    passed: list[tuple[int, bytes | None]] = []  # damaged steps (and their manifests, on rank 0)
    for i, step in enumerate(candidates):
        older = candidates[i + 1] if i + 1 < len(candidates) else None
        try:
            try:
                _load_committed(result, state, checkpointer, step)
            except IntegrityError as e:
                if not _intact_elsewhere(checkpointer, step, e, run_dir):
                    raise
                _load_again(result, state, checkpointer, step, e)
            _set_aside(checkpointer, passed)
            return
        except IntegrityError as e:
            log.warning("[rank %d] step %d does not load, trying older steps: %s", rdist.get_rank(), step, e)
            if rdist.get_rank() == 0:
                write_event(run_dir, "restore_fallback", group=group_id(), step=step, reason=str(e))
            damaged.append(f"step {step}: {e}")
            passed.append((step, _manifest_bytes(checkpointer, step)))
        if ram is not None:
            # A RAM apply writes every tensor and value, as a strict load. In place: the state holds
            # part of a failed load already, and if RAM does not restore either, the older step's
            # load overwrites it, or nothing loads (RestoreError below).
            fast = ram.restore(state, older, in_place=True)
            result.excluded += [x for x in fast.excluded if x not in result.excluded]
            if fast.step is not None and fast.source is not None:
                result.step, result.source, result.bytes = fast.step, fast.source, fast.bytes
                result.group_sources = fast.sources
                result.snapshot_timeline = fast.snapshot_timeline
                _set_aside(checkpointer, passed)
                return
    raise RestoreError(
        f"none of the {len(candidates)} committed steps under {checkpointer.url} loads; newest first: "
        f"{'; '.join(damaged)}. Check them with `resilient-ckpt verify --all {checkpointer.url}`, or set "
        f"checkpoint.resume=false to start afresh"
    )


_FAILED_ON = re.compile(r"\[rank (\d+)")
_TENSOR = re.compile(r"tensor '([^']+)'")


def _intact_elsewhere(checkpointer: Checkpointer, step: int, error: IntegrityError, run_dir: str) -> bool:
    """Collective: whether the tensor ``error`` names reads back intact, every crc32c matching, on
    another rank than the one that failed (a bad read on one node, not a damaged step: falling back
    would set a good step aside for everyone). False when the error names no tensor, or on one rank."""
    text = str(error)
    tensor, failed = _TENSOR.search(text), _FAILED_ON.search(text)
    world = rdist.get_world_size()
    if tensor is None:
        return False
    other = (int(failed.group(1)) + 1) % world if failed is not None else 0

    def recheck() -> list[str]:
        ref = open_checkpoint(checkpointer.url, step)
        return [p.message for p in verify_step(ref, patterns=[glob.escape(tensor.group(1))]).problems]

    try:
        problems = rdist.agree(recheck, src=other, what=f"re-reading tensor {tensor.group(1)!r} of step {step}")
    except ResilientError as e:  # could not re-read: the step counts as damaged, as before
        problems = [str(e)]
    if rdist.get_rank() == 0:
        write_event(run_dir, "restore_recheck", group=group_id(), step=step, rank=other, intact=not problems)
    return not problems


def _load_again(
    result: RestoreResult, state: dict[str, Any], checkpointer: Checkpointer, step: int, first: Exception
) -> None:
    """The step verified intact elsewhere: load it once more (a transient bad read passes); a
    second failure is that node's, never a reason to set a good step aside: raised on every rank."""
    log.warning(
        "[rank %d] step %d verifies intact on another rank: loading it again (%s)", rdist.get_rank(), step, first
    )
    try:
        _load_committed(result, state, checkpointer, step)
    except IntegrityError as again:
        raise RestoreError(
            f"step {step} under {checkpointer.url} verifies intact on another rank, but {again}; the node of that "
            f"rank reads storage wrongly (memory, disk cache, network): check it, or run without it"
        ) from again


def _manifest_bytes(checkpointer: Checkpointer, step: int) -> bytes | None:
    """Rank 0: the damaged step's manifest as found now (what may be set aside later)."""
    if rdist.get_rank() != 0:
        return None
    try:
        return checkpointer.store.read(f"{step_dir(step)}/{MANIFEST}")
    except Exception as e:  # noqa: BLE001 - then it is not set aside; never raised on one rank alone
        log.warning("cannot read the manifest of damaged step %d (%s): it will not be set aside", step, e)
        return None


def _set_aside(checkpointer: Checkpointer, steps: list[tuple[int, bytes | None]]) -> None:
    """Rank 0 sets the damaged steps the group fell back past aside (``retention.set_aside``): the
    run trains through those step numbers again, and a committed step is never overwritten. Only
    once an older state has loaded (with nothing loadable, every damaged step stays as it was: a
    rerun must not start afresh), and only a manifest still as found damaged. A failure here is
    warned, never raised on one rank alone."""
    for step, damaged in steps:
        if damaged is None:
            continue
        try:
            if set_aside(checkpointer.store, step, damaged):
                log.warning("damaged step %d set aside (%s); it will be saved again", step, SET_ASIDE_MANIFEST)
        except Exception as e:  # noqa: BLE001 - rank 0 only: its peers are already in the next collective
            log.warning(
                "cannot set damaged step %d aside (%s): its next save will fail; delete %s/%s",
                step,
                e,
                checkpointer.url,
                step_dir(step),
            )


def _load_committed(result: RestoreResult, state: dict[str, Any], checkpointer: Checkpointer, step: int) -> None:
    """Load committed ``step`` on every rank, or raise the same error on every rank (``load`` agrees
    on its outcome: a rank whose part of the step is damaged does not fail alone)."""
    checkpointer.load(state, step=step)
    result.step, result.source = step, "persistent"
    result.bytes = checkpointer.restore_stats[-1].bytes_read


def _committed_or_error(checkpointer: Checkpointer, *, ram_may_restore: bool) -> tuple[list[int], StorageError | None]:
    """The committed steps, or [] and the listing error when RAM may still restore."""
    try:
        return committed_steps(checkpointer), None
    except StorageError as e:
        if not ram_may_restore:
            raise
        # Storage unreachable: snapshots in RAM may still restore the run (newest known step).
        log.warning("[rank %d] %s; trying the RAM tier alone", rdist.get_rank(), e)
        return [], e


def committed_steps(checkpointer: Checkpointer) -> list[int]:
    """Committed steps under the checkpoint root, ascending; [] for a root that does not exist yet.

    Collective over the group: rank 0 lists, every rank gets the list or the same StorageError (a
    rank raising alone would leave its peers waiting in the next collective).
    """
    return rdist.agree(lambda: _list_committed(checkpointer), src=0)


def _list_committed(checkpointer: Checkpointer) -> list[int]:
    # A missing local directory or empty memory store means a fresh run; a missing bucket or an
    # unreachable endpoint is an error (starting afresh there would silently drop a run's progress).
    try:
        checkpointer.store.check_root(create=True)
        try:
            return checkpointer.steps()
        except StorageError:
            if checkpointer.location.scheme == "memory":
                return []
            raise
    except ResilientError as e:
        raise StorageError(f"cannot list checkpoints to resume from: {e}") from e


def describe(result: RestoreResult, url: str, layout: str) -> str:
    """The one line a run prints about its restore (``layout``: the mesh it resumed on)."""
    if not result.loaded:
        return f"no checkpoint under {url}: starting at step 0"
    where = _RAM_WHERE.get(result.source, url)
    if len(set(result.group_sources)) > 1:  # some ranks lost their own snapshot: name who took what
        ranks = {s: [r for r, x in enumerate(result.group_sources) if x == s] for s in ("own", "buddy")}
        where = f"RAM (own snapshot on ranks {ranks['own']}, the buddy node's copy on ranks {ranks['buddy']})"
    return f"resumed from step {result.step} of {where} on {layout} in {result.seconds:.2f} s"
