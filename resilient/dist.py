"""Thin helpers over torch.distributed that also work with no process group (one process).

Objects cross ranks as JSON in uint8 tensors, never as pickles (``dist.all_gather_object``
unpickles what a peer sent, and a peer transfer must not be able to run code): a value
round-trips as JSON does (tuples come back as lists, int dict keys as strings).

``agree`` is the one "compute here, fail together everywhere" collective: a rank that raised
alone before a collective would leave its peers waiting in that collective until the process
group's timeout, so every decision that can fail on some ranks goes through it.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from resilient.errors import from_payload, to_payload

T = TypeVar("T")


def is_distributed(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def barrier(group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race with another binder remains)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --- JSON over tensors ----------------------------------------------------------------------------


def _device(group: Any) -> torch.device:
    # NCCL moves only device tensors; every other backend (gloo, or "cpu:gloo,cuda:nccl") takes CPU.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(text: str, device: torch.device) -> torch.Tensor:
    data = bytearray(text.encode())  # never empty: "null" at least
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().numpy()).decode())


# An all-gather of a few hundred bytes among 4 gloo ranks on 2 cores took ~5 ms here, most of it
# latency; sending the length first and the text second doubled that on every save. A slot of
# this many bytes carries the length and a text that fits; a longer text sends only its remainder
# in a second round. Every rank must use the same size: a function of the world size only, never
# a value a rank learned. It shrinks as the world grows, so the slots of one all-gather stay
# within ~1 MiB per rank (16 KiB x 16k ranks would be 256 MiB on every device).
_HEADER = 8  # the text's length in bytes, int64


def slot_bytes(world_size: int) -> int:
    return max(256, min(16 << 10, (1 << 20) // max(1, world_size)))


class _TextGather:
    """An all-gather of one text per rank whose first round (the slots) is in flight; ``wait``
    finishes it. Started apart from its wait so that a caller can work while it crosses."""

    def __init__(self, text: str, group: Any) -> None:
        self._group, self._device = group, _device(group)
        self._mine = _encode(text, self._device)
        self._slot_bytes = slot_bytes(dist.get_world_size(group))
        n, inline = self._mine.numel(), self._slot_bytes - _HEADER
        slot = torch.zeros(self._slot_bytes, dtype=torch.uint8, device=self._device)
        slot[:_HEADER] = torch.tensor([n], dtype=torch.int64, device=self._device).view(torch.uint8)
        slot[_HEADER : _HEADER + min(n, inline)] = self._mine[:inline]
        self._slots = [torch.empty_like(slot) for _ in range(dist.get_world_size(group))]
        self._work = dist.all_gather(self._slots, slot, group=group, async_op=True)

    def wait(self) -> list[Any]:
        """Every rank's text, decoded as JSON, in rank order."""
        self._work.wait()
        mine, slots, inline = self._mine, self._slots, self._slot_bytes - _HEADER
        sizes = torch.stack([s[:_HEADER] for s in slots]).view(torch.int64).flatten().tolist()
        parts = [[s[_HEADER : _HEADER + min(size, inline)]] for s, size in zip(slots, sizes, strict=True)]
        longest = max(sizes)
        if longest > inline:  # a second round for what did not fit, padded to the longest remainder
            rest = torch.zeros(longest - inline, dtype=torch.uint8, device=self._device)
            rest[: max(0, mine.numel() - inline)] = mine[inline:]
            rests = [torch.empty_like(rest) for _ in slots]
            dist.all_gather(rests, rest, group=self._group)
            for part, r, size in zip(parts, rests, sizes, strict=True):
                part.append(r[: max(0, size - inline)])
        return [_decode(torch.cat(part)) for part in parts]


def _all_gather_text(text: str, group: Any) -> list[Any]:
    return _TextGather(text, group).wait()


def _broadcast_text(text: str, src: int, group: Any) -> Any:
    device = _device(group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    is_src = get_rank(group) == src
    mine = _encode(text, device) if is_src else torch.empty(0, dtype=torch.uint8, device=device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=global_src, group=group)
    data = mine if is_src else torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=global_src, group=group)
    return _decode(data)


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order."""
    text = json.dumps(obj)
    return _all_gather_text(text, group) if is_distributed() else [json.loads(text)]


def broadcast_json(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s JSON-able ``obj`` on every rank (``src`` is a rank of ``group``)."""
    if not is_distributed():
        return json.loads(json.dumps(obj))
    return _broadcast_text(json.dumps(obj) if get_rank(group) == src else "null", src, group)


# --- fail together --------------------------------------------------------------------------------


def _run_shared(fn: Callable[[], Any]) -> tuple[str, BaseException | None]:
    """``fn``'s outcome as the JSON text to share, and the error it raised (if any)."""
    try:
        # Encoded inside the try: a result JSON cannot hold is this rank's error, shared like
        # any other (raised here alone, it would leave the peers waiting in the collective).
        return json.dumps({"ok": fn()}), None
    except Exception as e:  # shared, then raised on every rank
        return json.dumps({"error": to_payload(e)}), e


def _settle(outcomes: list[Any], rank: int, local_error: BaseException | None, what: str) -> None:
    """Raise the first failing rank's error, the same on every rank, if any rank failed."""
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if o is not None and "error" in o]
    if failed:
        first_rank, payload = failed[0]
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        err = from_payload(payload, prefix=f"{what + ': ' if what else ''}[rank {first_rank}{others}] ")
        if first_rank == rank and local_error is not None:
            raise err from local_error  # this rank's own traceback, not a copy of it
        raise err


def raise_first(outcomes: list[Any], rank: int, local_error: BaseException | None, what: str = "") -> None:
    """Given every rank's ``None`` or ``{"error": to_payload(e), ...}`` (rank order, the same list
    on every rank), raise the first failing rank's error, the same on every rank, as ``agree``
    does; for a caller that gathered the outcomes itself (with more than the error in them)."""
    _settle(outcomes, rank, local_error, what)


def agree(fn: Callable[[], T], *, group: Any = None, src: int | None = None, what: str = "") -> Any:
    """Run ``fn`` on rank ``src`` of ``group`` (or on every rank when ``src`` is None) and share
    the outcome: every rank returns ``src``'s result (or the list of every rank's results, in rank
    order), or every rank raises the SAME error — the first failing rank's, its class kept, its
    message prefixed with the rank (and ``what``), the remote traceback as its cause.

    ``fn``'s result must be JSON-able. Any ``Exception`` counts as failure; a ``BaseException``
    (KeyboardInterrupt, SystemExit) still propagates on its own rank only.
    """
    if src is None:
        return agree_async(fn, group=group, what=what).result()
    rank = get_rank(group)
    text, local_error = _run_shared(fn) if rank == src else ("null", None)
    outcomes: list[Any] = [None] * get_world_size(group)
    outcomes[src] = _broadcast_text(text, src, group) if is_distributed() else json.loads(text)
    _settle(outcomes, rank, local_error, what)
    return outcomes[src]["ok"]


class Agreement:
    """An ``agree`` over every rank whose collective is in flight (``agree_async``)."""

    def __init__(self, text: str, local_error: BaseException | None, group: Any, what: str) -> None:
        self._rank, self._local_error, self._what = get_rank(group), local_error, what
        self._gather = _TextGather(text, group) if is_distributed() else None
        self._outcomes = None if self._gather is not None else [json.loads(text)]

    @property
    def local_error(self) -> BaseException | None:
        """The error ``fn`` raised on this rank (its peers' are known only to ``result``)."""
        return self._local_error

    def result(self) -> list[Any]:
        """Every rank's result in rank order, or the same error raised on every rank, as ``agree``.
        Call it exactly once, on every rank, before this group's next collective."""
        if self._outcomes is None:
            self._outcomes = self._gather.wait()
        _settle(self._outcomes, self._rank, self._local_error, self._what)
        return [o["ok"] for o in self._outcomes]


def agree_async(fn: Callable[[], Any], *, group: Any = None, what: str = "") -> Agreement:
    """``agree(fn)`` over every rank, split in two: ``fn`` runs and its outcome starts crossing
    now; ``.result()`` returns or raises what ``agree`` would. Whatever a rank does between the two
    must not depend on the others' outcome (e.g. work it throws away if the agreement says so)."""
    text, local_error = _run_shared(fn)
    return Agreement(text, local_error, group, what)
