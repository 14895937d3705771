"""The trainer-side half of ``resilient-chaos``: one step hook, ``run.step_hooks=["resilient.chaos.hooks:chaos_hook"]``.

The harness talks to it through files under ``$RESILIENT_CHAOS_DIR`` (``<run.dir>/chaos``), never
through signals, so the hook needs nothing but the file system:

- ``arm/group<G>``: a ``RESILIENT_FAULTS`` spec that this group's ranks put in their environment
  (read when the hook is built, i.e. before a restarted rank heals, and after every step), with
  ``RESILIENT_FAULTS_DIR=markers/group<G>``: fault points can then be armed at a given step and
  for one group, which the launch environment (fixed, shared by all groups) cannot do;
- ``hold``: a step number; ranks past it wait while the file exists (the harness removes it once
  every killed group is joining again), so a paced run cannot end before a restarted group heals;
- ``arm/corrupt-group<G>``: test-only; the group adds 1e-3 to one parameter once (the harness must
  then fail ``replicas_identical`` and ``twin_match``);
- ``arm/slow-group<G>``: a JSON list of slow spans ``{"fault", "rank", "first_step", "last_step",
  "delay_s"}`` (fault kind ``slow_rank``); the named rank sleeps ``delay_s`` at the start of its compute in each
  of those steps and records a ``slowed`` event in ``hook_events.jsonl`` when a span begins;
- ``digests/group<G>.jsonl``: written by the hook, the sha256 of the group's full parameters after
  every committed step: replicas are compared step by step, so a heal that delivered wrong bits is
  caught at the step it happened, not only at the end.

Pacing (``RESILIENT_CHAOS_STEP_SLEEP``) sleeps after each step, after the digest.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from resilient.runfiles import HOOK_EVENTS_FILE, append_jsonl
from resilient.state import state_digest

CHAOS_DIR_ENV = "RESILIENT_CHAOS_DIR"
STEP_SLEEP_ENV = "RESILIENT_CHAOS_STEP_SLEEP"
HOOK_PATH = "resilient.chaos.hooks:chaos_hook"
HOLD_FILE = "hold"
HOLD_MAX_S = 120.0
"""A hold never lasts longer than this (a group that never comes back must not hang the run)."""


def arm_path(chaos_dir: str, group: int) -> str:
    return os.path.join(chaos_dir, "arm", f"group{group}")


def corrupt_path(chaos_dir: str, group: int) -> str:
    return os.path.join(chaos_dir, "arm", f"corrupt-group{group}")


def slow_path(chaos_dir: str, group: int) -> str:
    return os.path.join(chaos_dir, "arm", f"slow-group{group}")


def marker_dir(chaos_dir: str, group: int) -> str:
    return os.path.join(chaos_dir, "markers", f"group{group}")


def digest_path(chaos_dir: str, group: int) -> str:
    return os.path.join(chaos_dir, "digests", f"group{group}.jsonl")


def write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class _ChaosHook:
    def __init__(self, trainer: Any, chaos_dir: str) -> None:
        self.dir = chaos_dir
        self.group = int(getattr(trainer, "group", 0))
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.sleep_s = float(os.environ.get(STEP_SLEEP_ENV, "0") or 0)
        self.corrupted = False
        self.trainer = trainer
        self.slow_spans: list[dict[str, Any]] = []
        self._slowed_faults: set[int] = set()
        self.arm()
        # Inside the step, before its first collective: a sleep between steps lies outside every
        # step timer, so the slow rank would look the fastest (it finds its peers already waiting
        # in the next collective); a sleep inside the forward shows on every rank of an FSDP group
        # alike (they wait in its all-gathers). Here its peers wait in grad_sync_s and it alone
        # has the long compute_s, which is what straggler detection compares.
        trainer.before_compute.append(self._slow_step)

    def arm(self) -> None:
        """Mirror ``arm/group<G>`` into this process's environment (fault points read it at call time)."""
        try:
            with open(arm_path(self.dir, self.group)) as f:
                spec = f.read().strip()
        except FileNotFoundError:
            spec = ""
        if spec:
            os.environ["RESILIENT_FAULTS"] = spec
            os.environ["RESILIENT_FAULTS_DIR"] = marker_dir(self.dir, self.group)
        else:
            os.environ.pop("RESILIENT_FAULTS", None)
        self.slow_spans = _read_slow_spans(slow_path(self.dir, self.group))

    def __call__(self, step: int, trainer: Any) -> None:
        self.arm()
        self._maybe_corrupt(trainer)
        digest = _params_digest(trainer.parts.model, trainer.pp_group)
        if self.rank == 0:
            record = {
                "t": round(time.time(), 4),
                "step": step,
                "params_sha256": digest,
                "attempt": self.attempt,
                "healed": bool(getattr(trainer, "heals", None)),
            }
            append_jsonl(digest_path(self.dir, self.group), record)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        self._maybe_hold(step)

    def _slow_step(self, step: int) -> None:
        """Sleep if this rank is slow in ``step``, the step being computed."""
        spans = [s for s in self.slow_spans if s["rank"] == self.rank and s["first_step"] <= step <= s["last_step"]]
        if not spans:
            return
        time.sleep(sum(s["delay_s"] for s in spans))
        for span in spans:
            if span["fault"] not in self._slowed_faults:
                self._slowed_faults.add(span["fault"])
                with contextlib.suppress(OSError):  # before the step's first collective: never raise here
                    append_jsonl(
                        os.path.join(self.dir, HOOK_EVENTS_FILE),
                        {
                            "t": round(time.time(), 4),
                            "event": "slowed",
                            "group": self.group,
                            "rank": self.rank,
                            "step": step,
                            "delay_s": span["delay_s"],
                            "fault": span["fault"],
                        },
                    )

    def _maybe_corrupt(self, trainer: Any) -> None:
        if self.corrupted or not os.path.exists(corrupt_path(self.dir, self.group)):
            return
        import torch
        from torch.distributed.tensor import DTensor

        param = next(iter(trainer.parts.model.parameters()))
        local = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            local.add_(1e-3)
        self.corrupted = True
        if self.rank == 0:
            append_jsonl(
                os.path.join(self.dir, HOOK_EVENTS_FILE),
                {"t": round(time.time(), 4), "event": "corrupted", "group": self.group},
            )

    def _maybe_hold(self, step: int) -> None:
        path = os.path.join(self.dir, HOLD_FILE)
        try:
            with open(path) as f:
                hold_step = int(f.read().strip() or 0)
        except (FileNotFoundError, ValueError):
            return
        if step < hold_step:
            return
        start = time.time()
        deadline = time.monotonic() + HOLD_MAX_S
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.rank == 0:
            append_jsonl(
                os.path.join(self.dir, HOOK_EVENTS_FILE),
                {
                    "t": round(time.time(), 4),
                    "event": "held",
                    "group": self.group,
                    "step": step,
                    "start": round(start, 4),
                    "seconds": round(time.time() - start, 4),
                },
            )


def _read_slow_spans(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:  # written by temp + rename: a torn file is a harness bug
        raise ValueError(f"{path}: not a JSON list of slow spans ({e}); it is written by the chaos harness") from e


def _params_digest(model: Any, pp_group: Any) -> str:
    """sha256 over the full parameters, every pipeline stage's (collective within the group)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return state_digest(get_model_state_dict(model), group=pp_group)


def chaos_hook(trainer: Any) -> _ChaosHook | None:
    """The step-hook factory (``run.step_hooks``); None when not run by the harness."""
    chaos_dir = os.environ.get(CHAOS_DIR_ENV)
    return _ChaosHook(trainer, chaos_dir) if chaos_dir else None
