"""What a rank records about its own run beyond the step metrics (docs/observability.md): who it
is (run id, incarnation, layout), how its start went, where its step time goes, who is slow, and
whether it hangs. The loop calls ``RunObserver`` at a few points; everything else is here.

Every call that writes is a side effect: a file that cannot be written is warned about, never
raised (``runfiles.write_event`` / ``RunOutputs``), so observing never decides a step or a save.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from resilient import dist as rdist
from resilient.incarnations import startup_cause
from resilient.runfiles import (
    RANKS_FILE,
    append_jsonl,
    group_file,
    group_id,
    read_events,
    stamp_records,
    write_event,
)
from resilient.trainer.config import TrainConfig
from resilient.trainer.observing.straggler import GroupWatch, StallClock, StragglerWatch
from resilient.trainer.observing.timing import StartupClock, StepPhases, gather_window

log = logging.getLogger(__name__)


class RunObserver:
    """One per rank. ``incarnation`` is agreed by the caller (rank 0 counts it, all ranks share it)."""

    def __init__(self, config: TrainConfig, *, world: int, incarnation: int, directory: str, clock: StartupClock):
        self.config = config
        self.rank = rdist.get_rank()
        self.group = group_id()
        self.incarnation = incarnation
        self.directory = directory
        self.clock = clock
        self.phases = StepPhases()
        p = config.parallel
        self.layout = {"world": world, "pp": p.pp, "dp_shard": p.dp_shard, "tp": p.tp, "groups": config.replica.groups}
        m = config.metrics
        self._stragglers = StragglerWatch(m.straggler_factor, m.straggler_windows)
        self._stall = StallClock().start() if m.rank_every else None
        self._groups = None
        r = config.replica
        if m.rank_every and r.enabled and r.groups > 1 and self.rank == 0:
            paths = {g: group_file(config.run.dir, RANKS_FILE, g) for g in range(r.groups)}
            self._groups = GroupWatch(self.group, paths, m.straggler_windows, m.rank_every)
        self._held_at_window = 0.0
        self._started = False
        self.restore_sources: list[str] = []
        """Every rank's restore source of this start (set by the trainer): evidence of the cause."""
        self.cause = ""
        """Why this start happened (``resilient.incarnations``), known once the startup is written."""
        self.watchdog = None
        stamp_records(run_id=None, incarnation=incarnation)  # the run id comes with the restore

    # -- start -------------------------------------------------------------------------------

    def restored(self, run_id: str) -> None:
        """The checkpoint root's run id is known (every restore reads it): records carry it from now."""
        stamp_records(run_id=run_id, incarnation=self.incarnation)
        self.clock.mark("restore")

    def attempt(self, step: int) -> None:
        """A step attempt begins: the watchdog starts with the first and hears every one (a retry
        after an uncommitted step, a heal served in a quorum, are not silence)."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
            return
        timeout = self.config.run.hang_timeout_s
        if timeout <= 0:
            return
        from resilient.trainer.observing.watchdog import HangWatchdog

        self.watchdog = HangWatchdog(
            self.directory,
            group=self.group,
            rank=self.rank,
            incarnation=self.incarnation,
            timeout_s=timeout,
            on_hang=lambda record: write_event(self.config.run.dir, **record),
        )
        self.watchdog.start()
        self.watchdog.beat(step)

    # -- every committed step ----------------------------------------------------------------

    def committed(self, step: int, step_time: float) -> None:
        """After a committed step's metrics: the startup record once, the per-rank window when due
        (collective: every rank of the group calls this at every committed step)."""
        self.phases.commit(step_time)
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if not self._started:
            self._started = True
            self.clock.mark("first_step")
            if self.rank == 0:
                self.cause = self._cause()
                write_event(
                    self.config.run.dir,
                    "startup",
                    group=self.group,
                    cause=self.cause,
                    layout=self.layout,
                    total_s=self.clock.total(),
                    phases=self.clock.phases(),
                )
        every = self.config.metrics.rank_every
        if every and step % every == 0:
            self._window(step)

    def _cause(self) -> str:
        """Why this incarnation started, from the previous incarnation's events (rank 0 reads them)."""
        return startup_cause(
            read_events(self.config.run.dir),
            group=self.group,
            incarnation=self.incarnation,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            restore_sources=self.restore_sources,
        )

    def _window(self, step: int) -> None:
        steps = self.phases.steps
        held = None
        if self._stall is not None:
            now = self._stall.held_s()
            held, self._held_at_window = now - self._held_at_window, now
        ranks = gather_window(self.phases, held)
        if ranks is None:
            return
        try:
            append_jsonl(os.path.join(self.directory, RANKS_FILE), {"step": step, "steps": steps, "ranks": ranks})
        except OSError as e:  # rank 0 alone: raising would leave its peers in the next collective
            log.warning("cannot write %s in %s (%s); training goes on", RANKS_FILE, self.directory, e)
        changes = self._stragglers.check(ranks, step)
        if self._groups is not None:
            changes += self._groups.check(ranks, step, steps)
        for change in changes:
            write_event(self.config.run.dir, group=self.group, step=step, **change)
            self._say(change)

    def _say(self, change: dict[str, Any]) -> None:
        """One line when an episode starts, one when it ends: not one per window."""
        who = "the whole group" if change["rank"] is None else f"rank {change['rank']}"
        if change["event"] == "straggler_cleared":
            log.warning(
                "[group %d] %s is no longer a straggler (%s, for %d steps)",
                self.group,
                who,
                change["phase"],
                change["duration_steps"],
            )
            return
        late = f", {change['late_s'] * 1e3:.0f} ms late at the sync" if "late_s" in change else ""
        log.warning(
            "[group %d] %s is a straggler: %s is %.3f s a step against its peers' %.3f s "
            "(%.0f%% of the step) for %d windows of %d steps%s",
            self.group,
            who,
            change["phase"],
            change["value_s"],
            change["median_s"],
            100 * change["share"],
            self.config.metrics.straggler_windows,
            self.config.metrics.rank_every,
            late,
        )

    # -- end ---------------------------------------------------------------------------------

    def paused(self) -> Any:
        """The watchdog looks away (the final save may take long); a no-op context without one."""
        import contextlib

        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self._stall is not None:
            self._stall.stop()
            self._stall = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
