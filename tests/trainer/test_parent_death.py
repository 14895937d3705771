"""trainer/launching/lighthouse.py: a child that must not outlive its parent asks Linux for a signal when the
parent dies, and signals itself when the parent died before it asked (nobody would send it)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator

import pytest

from resilient.trainer.launching import lighthouse
from resilient.trainer.launching.lighthouse import PR_SET_PDEATHSIG, die_with_parent, set_parent_death_signal

pytestmark = [
    pytest.mark.timeout(10),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's"),
]
_PRCTL = ctypes.CDLL(None).prctl  # before any test replaces ctypes.CDLL


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(lighthouse.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    yield sent
    _PRCTL(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # this test process: no death signal


def test_a_parent_that_died_before_the_call_makes_the_process_signal_itself(
    kills: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    set_parent_death_signal(signal.SIGTERM, os.getppid())
    assert kills == []  # the parent is there: Linux sends the signal when it dies
    started_under = os.getppid()
    monkeypatch.setattr(lighthouse.os, "getppid", lambda: 1)  # reparented to init: torchrun is gone
    set_parent_death_signal(signal.SIGTERM, started_under)
    assert kills == [(os.getpid(), signal.SIGTERM)]


def test_the_preexec_hook_resolves_prctl_before_the_fork(
    kills: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    preexec = die_with_parent(signal.SIGTERM)
    assert preexec is not None

    def no_dlopen(*args: object, **kwargs: object) -> None:
        raise AssertionError("dlopen in the forked child")

    monkeypatch.setattr(lighthouse.ctypes, "CDLL", no_dlopen)
    monkeypatch.setattr(lighthouse.os, "getppid", os.getpid)  # as seen from the child
    preexec()
    assert kills == []
    monkeypatch.setattr(lighthouse.os, "getppid", lambda: 1)
    preexec()
    assert kills == [(os.getpid(), signal.SIGTERM)]
