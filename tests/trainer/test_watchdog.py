"""The hang watchdog: a silent rank dumps every thread's stack once per hang; beats and pauses keep it quiet."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from resilient.trainer.observing.watchdog import HangWatchdog, flight_recorder_env, hang_path

TIMEOUT_S = 0.3
"""Short enough for a fast test; the watchdog checks every TIMEOUT_S / 4."""


class _Events:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.fired = threading.Event()

    def __call__(self, event: dict) -> None:
        self.events.append(event)
        self.fired.set()


def _watchdog(tmp_path, events: _Events, **kwargs) -> HangWatchdog:
    group_dir = str(tmp_path / "group1")
    return HangWatchdog(group_dir, group=1, rank=3, incarnation=2, timeout_s=TIMEOUT_S, on_hang=events, **kwargs)


def _stuck_in_a_collective(events: _Events, timeout_s: float) -> bool:
    """Stands for an all_reduce that never returns; its name must show in the dump."""
    return events.fired.wait(timeout_s)


@pytest.mark.timeout(20)
def test_silence_dumps_all_stacks_once(tmp_path, caplog) -> None:
    events = _Events()
    watchdog = _watchdog(tmp_path, events)
    caplog.set_level(logging.WARNING, logger="resilient.trainer.observing.watchdog")
    watchdog.start()
    try:
        for step in range(1, 4):
            watchdog.beat(step)
            time.sleep(0.02)
        t0 = time.monotonic()
        assert _stuck_in_a_collective(events, timeout_s=5.0), "no hang reported within 5 s"
        waited = time.monotonic() - t0
        time.sleep(4 * TIMEOUT_S)  # still silent: the same hang must not be reported again
    finally:
        assert watchdog.stop(timeout_s=2.0)
    assert TIMEOUT_S * 0.9 <= waited <= TIMEOUT_S + 1.0
    assert len(events.events) == 1 and watchdog.hangs == 1
    event = events.events[0]
    assert event["event"] == "hang" and event["group"] == 1 and event["rank"] == 3 and event["step"] == 3
    assert event["idle_s"] >= TIMEOUT_S
    assert event["path"] == os.path.join("group1", "hang", "rank3-2.txt")
    path = hang_path(str(tmp_path / "group1"), 3, 2)
    assert os.path.exists(path) and not [p for p in os.listdir(os.path.dirname(path)) if ".tmp" in p]
    with open(path) as f:
        text = f.read()
    python_part, _, faulthandler_part = text.partition("# faulthandler.dump_traceback")
    assert "--- thread MainThread" in python_part and "_stuck_in_a_collective" in python_part
    assert "hang-watchdog-rank3" in python_part  # every thread, the watchdog's own included
    assert "_stuck_in_a_collective" in faulthandler_part and "Current thread" in faulthandler_part
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no step for" in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
    assert watchdog.error is None


@pytest.mark.timeout(20)
def test_rearms_after_the_next_beat(tmp_path) -> None:
    events = _Events()
    watchdog = _watchdog(tmp_path, events)
    watchdog.start()
    try:
        watchdog.beat(1)
        assert events.fired.wait(5.0)
        events.fired.clear()
        watchdog.beat(2)
        assert events.fired.wait(5.0), "a second hang after a new beat must be reported"
    finally:
        assert watchdog.stop(timeout_s=2.0)
    assert [e["step"] for e in events.events] == [1, 2]
    # Each hang's event names its own dump: the second does not overwrite the first.
    first, second = (e["path"] for e in events.events)
    assert (first, second) == ("group1/hang/rank3-2.txt", "group1/hang/rank3-2-2.txt")
    assert (tmp_path / first).exists() and (tmp_path / second).exists()


@pytest.mark.timeout(20)
def test_beats_keep_it_quiet(tmp_path) -> None:
    events = _Events()
    watchdog = _watchdog(tmp_path, events)
    watchdog.start()
    try:
        deadline = time.monotonic() + 4 * TIMEOUT_S
        step = 0
        while time.monotonic() < deadline:
            step += 1
            watchdog.beat(step)
            time.sleep(TIMEOUT_S / 6)
    finally:
        assert watchdog.stop(timeout_s=2.0)
    assert events.events == [] and watchdog.hangs == 0 and step > 10
    assert not os.path.exists(tmp_path / "group1" / "hang")


@pytest.mark.timeout(20)
def test_pause_suppresses_and_resume_restarts_the_window(tmp_path) -> None:
    events = _Events()
    watchdog = _watchdog(tmp_path, events)
    watchdog.start()
    try:
        watchdog.beat(7)
        with watchdog.paused():
            time.sleep(4 * TIMEOUT_S)  # a long restore
        assert events.events == []
        # After resume the silence counts from the resume, not from the last beat.
        time.sleep(TIMEOUT_S / 3)
        assert events.events == []
        assert events.fired.wait(5.0)
    finally:
        assert watchdog.stop(timeout_s=2.0)
    assert len(events.events) == 1 and events.events[0]["step"] == 7


@pytest.mark.timeout(10)
def test_stop_returns_promptly(tmp_path) -> None:
    events = _Events()
    watchdog = HangWatchdog(str(tmp_path), group=0, rank=0, incarnation=0, timeout_s=60.0, on_hang=events)
    watchdog.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    assert watchdog.stop(timeout_s=5.0)
    # The thread sleeps in Event.wait(1 s), which stop() wakes at once.
    assert time.monotonic() - t0 < 0.5
    assert not [t for t in threading.enumerate() if t.name == "hang-watchdog-rank0"]
    assert watchdog.stop() is True  # twice is harmless


@pytest.mark.timeout(20)
def test_context_manager_and_restart_after_stop(tmp_path) -> None:
    events = _Events()
    with _watchdog(tmp_path, events) as watchdog:
        watchdog.beat(1)
        assert events.fired.wait(5.0)
    assert watchdog._thread is None
    events.fired.clear()
    watchdog.start()  # started again after a stop: it watches again
    try:
        watchdog.beat(2)
        assert events.fired.wait(5.0)
    finally:
        assert watchdog.stop(timeout_s=2.0)
    assert [e["step"] for e in events.events] == [1, 2]


@pytest.mark.timeout(20)
def test_a_failing_callback_is_logged_once_and_never_raised(tmp_path, caplog) -> None:
    calls = []

    def broken(event: dict) -> None:
        calls.append(event)
        raise RuntimeError("sink is gone")

    watchdog = HangWatchdog(str(tmp_path / "group0"), group=0, rank=0, incarnation=0, timeout_s=0.1, on_hang=broken)
    caplog.set_level(logging.WARNING, logger="resilient.trainer.observing.watchdog")
    watchdog.start()
    try:
        for step in range(3):  # three hang episodes, three failures
            watchdog.beat(step)
            deadline = time.monotonic() + 5.0
            while len(calls) <= step and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        assert watchdog.stop(timeout_s=2.0)
    assert len(calls) == 3 and watchdog.hangs == 3
    assert isinstance(watchdog.error, RuntimeError) and str(watchdog.error) == "sink is gone"
    failures = [r for r in caplog.records if "failed while reporting" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None


@pytest.mark.timeout(10)
def test_flight_recorder_env_points_into_the_hang_folder(tmp_path) -> None:
    env = flight_recorder_env(str(tmp_path / "group0"))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "group0" / "hang" / "nccl_trace_rank_")
    assert (tmp_path / "group0" / "hang").is_dir()
    assert all(isinstance(v, str) for v in env.values())


@pytest.mark.timeout(10)
def test_bad_timeout_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="timeout_s=0"):
        HangWatchdog(str(tmp_path), group=0, rank=0, incarnation=0, timeout_s=0)
