"""The job's torchft lighthouse: started, waited for, and the process helpers the launcher shares.

A lighthouse this launcher started is restarted by ``ReplicaJob`` if it dies; why a restarted one
must need every healthy group first is told at ``ReplicaJob._supervise_lighthouse``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

from resilient.errors import ConfigError

LIGHTHOUSE_START_TIMEOUT_S = 60.0
"""torchft_lighthouse is a Python console script: it imports torch before it listens (1.5-6.5 s)."""


def lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(found):
        raise ConfigError("torchft_lighthouse is not next to the Python interpreter nor on PATH: pip install torchft")
    return found


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the lighthouse exited with {proc.returncode} before listening on {host}:{port}")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s} s (lighthouse start)")


RELAX_AFTER_S = 2.0
"""How long a group must have lost a worker, its torchrun still running, before a lighthouse that
needs every group is restarted needing one (``ReplicaJob._relax_lighthouse``)."""


def start_lighthouse(
    port: int,
    log: IO[str],
    *,
    join_timeout_ms: int,
    heartbeat_timeout_ms: int,
    bind: str = "127.0.0.1",
    min_replicas: int = 1,
    endpoint: str = "",
) -> subprocess.Popen:
    """A lighthouse on bind:port, listening when this returns. ``min_replicas`` 1: a group trains
    alone while the others are down (that is the point); the lighthouse's majority rule
    (participants > half of the heartbeating groups) keeps two disjoint quorums from forming, as
    long as it has heard every live group. A restarted lighthouse has not (``ReplicaJob``).
    ``endpoint`` (``HOST:PORT`` of a job across nodes): bind where HOST resolves instead."""
    bind = interface_of(endpoint) if endpoint else bind
    command = [
        lighthouse_binary(),
        "--bind",
        f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}",
        "--min_replicas",
        str(min_replicas),
        "--join_timeout_ms",
        str(join_timeout_ms),
        "--heartbeat_timeout_ms",
        str(heartbeat_timeout_ms),
    ]
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGKILL),
    )
    reach = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind.strip("[]")
    try:
        wait_for_port(reach, port, LIGHTHOUSE_START_TIMEOUT_S, proc)
    except BaseException:
        kill_group(proc)
        raise
    return proc


def interface_of(endpoint: str) -> str:
    """The local address the job's lighthouse binds to for ``HOST:PORT`` (``--rdzv-endpoint``):
    HOST's, so that it listens on the job's interface only, never on every interface (torchft's
    lighthouse has no authentication: ``recovery.quorum_auth``). ConfigError when HOST does not
    resolve."""
    host = endpoint.rpartition(":")[0].strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ConfigError(f"--rdzv-endpoint {endpoint}: cannot resolve {host!r} to bind the lighthouse to ({e})") from e


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child that must not outlive the process starting it: Linux sends the
    child ``sig`` when its parent dies, also by SIGKILL or the OOM killer, which run no cleanup.
    The children run in sessions of their own (a terminal's Ctrl-C reaches them once, through the
    launcher), so nothing else would stop them: a torchrun left behind restarts its workers into
    a rendezvous nobody joins, holding their memory. None off Linux (no such call)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    # Resolved here, before the fork: dlopen and the symbol lookup take locks and allocate, which a
    # forked child of a threaded parent must not do before it execs.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody will send it
            os.kill(os.getpid(), sig)

    return preexec


def set_parent_death_signal(sig: int, parent: int) -> None:
    """This process gets ``sig`` when its parent dies (Linux; a no-op elsewhere). ``parent``: the
    parent's pid as read earliest (``os.getppid()`` at start): a parent that died before the call
    sends nothing, so the process signals itself then."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # reparented (to init or a subreaper): the parent is gone
        os.kill(os.getpid(), sig)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def kill_group(proc: subprocess.Popen) -> None:
    signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def free_port() -> int:
    from resilient.dist import free_port  # deferred: resilient.dist imports torch

    return free_port()
