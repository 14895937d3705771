"""The ``[checkpoint]`` section of a recipe: when and where the trainer saves, the Checkpointer's
own settings (every ``CheckpointerConfig`` field is a ``checkpoint.*`` key) and the cadence keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resilient.errors import ConfigError
from resilient.storage.config import CheckpointerConfig
from resilient.trainer.cadence_config import check_cadence
from resilient.trainer.cadence_model import LLAMA3_NODE_MTBF_S
from resilient.validate import check_bool, check_int, check_number

STORAGE_DEFAULTS: dict[str, Any] = {"keep_last": 3}
"""A trainer keeps the 3 newest steps unless the recipe says otherwise (the library keeps all)."""
STORAGE_SET_BY_TRAINER = ("metrics_path",)
"""CheckpointerConfig fields the trainer wires itself (not recipe keys): rank 0's ``saves.jsonl``."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """The ``[checkpoint]`` section: when and where the trainer saves (the keys below), and the
    Checkpointer's own settings (``storage``: every ``CheckpointerConfig`` field is a
    ``checkpoint.*`` key with the meaning documented there: ``keep_last``, ``writer``, ``if_busy``,
    ``io_threads``, ``staging_bytes``, ``max_inflight``, ``commit_timeout_s``, ...)."""

    url: str = ""
    """Checkpoint root: a path, file:// or s3:// URL (not memory://: each rank has its own and none
    outlives the run). Empty: ``<run.dir>/ckpt``."""
    persist_every: int = 50
    """Save every this many steps, and always at the end; >= 1."""
    resume: bool = True
    """Start from the newest committed step under ``url`` when there is one."""
    timeout_s: float = 1800.0
    """The default of ``commit_timeout_s`` and ``close_timeout_s`` (whichever the recipe leaves
    unset), and how long a replica group waits at the end for the group that writes the last step."""
    memory_every: int = 0
    """RAM tier: snapshot into the node-local store every this many steps (0: off); see [recovery]."""
    memory_keep: int = 2
    """RAM snapshots each rank keeps in its node store (and its buddy keeps of it); >= 1."""
    load_step: int | None = None
    """Resume from this committed step instead of the newest (unset: the newest that loads). RAM
    snapshots of later steps are not used and never come back (a new timeline). Must name a
    committed step under ``url`` with none after it (those would be saved again); applies once: a
    restart with the same value goes on from where the rewound run got to."""
    storage: CheckpointerConfig = field(default_factory=lambda: CheckpointerConfig(**STORAGE_DEFAULTS))
    """The Checkpointer's settings (keys ``checkpoint.keep_last``, ``checkpoint.io_threads``, ...)."""

    # -- cadence (docs/cadence.md): how the intervals above may change during a run -------------
    cadence: str = "fixed"
    """'fixed': ``memory_every`` / ``persist_every`` as set. 'adaptive': those are the starting
    values; each tier that is on is re-chosen as the run goes from its measured cost, restore time
    and the run's failures (Young/Daly per tier), within its range; event ``cadence`` on change."""
    memory_every_range: list[int] = field(default_factory=lambda: [1, 10_000])
    """Adaptive: [min, max] steps of the RAM snapshot interval (``persist_every_range``: durable)."""
    persist_every_range: list[int] = field(default_factory=lambda: [1, 100_000])
    mtbf_prior_s: float = LLAMA3_NODE_MTBF_S
    """Adaptive: mean seconds between interruptions of ONE node before the run has evidence (the
    job's: this / its nodes); default: the Llama 3 report's (``cadence_model.LLAMA3_NODE_MTBF_S``)."""
    max_loss_s: float = 0.0
    """Adaptive: the most work (seconds of training) a whole-job loss may cost: caps the durable
    interval whatever the estimate says, over ``persist_every_range`` too (0: no cap)."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigError(f"checkpoint.url={self.url!r} must be a string (a path or a URL)")
        check_int("checkpoint.persist_every", self.persist_every, 1)
        check_bool("checkpoint.resume", self.resume)
        check_number("checkpoint.timeout_s", self.timeout_s, 1.0, 7 * 86400.0)
        check_int("checkpoint.memory_every", self.memory_every, 0)
        check_int("checkpoint.memory_keep", self.memory_keep, 1, 1000)
        check_cadence(self)
        if self.load_step is not None:
            check_int("checkpoint.load_step", self.load_step, 0)
            if not self.resume:
                raise ConfigError(
                    f"checkpoint.load_step={self.load_step} needs checkpoint.resume=true (resume off starts "
                    f"at step 0): unset one of them"
                )

    def storage_defaults(self) -> dict[str, Any]:
        """The trainer's defaults of the Checkpointer's keys, where they differ from the library's."""
        return {**STORAGE_DEFAULTS, "commit_timeout_s": self.timeout_s, "close_timeout_s": self.timeout_s}
