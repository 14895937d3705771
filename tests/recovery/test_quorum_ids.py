"""Quorum ids the Manager builds its cross-group process group under never repeat, even across a
lighthouse restart (which counts from 1 again), and every member of a quorum derives the same one."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from resilient.errors import QuorumError
from resilient.recovery.quorum import ReplicaGroupSync, _QuorumClient

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeResult:
    quorum_id: int
    replica_ids: list[str]
    max_step: int
    store_address: str = "127.0.0.1:1"


@dataclass
class FakeLighthouse:
    """Hands out the results queued for it, one per ``_quorum`` call."""

    results: list[FakeResult] = field(default_factory=list)

    def _quorum(self, **_: object) -> FakeResult:
        r = self.results.pop(0)
        if r is None:
            raise TimeoutError("the lighthouse is down")
        return FakeResult(r.quorum_id, list(r.replica_ids), r.max_step)


def _ids(results: list[FakeResult | None]) -> list[int | None]:
    """The id each call gives (None: the call failed, as during a lighthouse outage)."""
    client = _QuorumClient(FakeLighthouse(list(results)))
    out: list[int | None] = []
    for _ in results:
        try:
            out.append(client._quorum().quorum_id)
        except TimeoutError:
            out.append(None)
    return out


A, B, B2 = "group00000:a", "group00001:b", "group00001:b2"


def test_a_restarted_lighthouse_never_hands_the_manager_an_id_it_built_a_group_under() -> None:
    # Lighthouse 1: A alone (id 1), then A+B (id 2). Killed and restarted: A+B is id 1 again,
    # then B restarts (new uuid) and A+B2 is id 2 again. torchft's store prefix is the id.
    history = [
        FakeResult(1, [A], 0),
        FakeResult(2, [A, B], 1),
        FakeResult(2, [A, B], 2),  # same quorum, next step: no rebuild
        FakeResult(1, [A, B], 5),  # the restarted lighthouse
        FakeResult(1, [A, B], 6),
        FakeResult(2, [A, B2], 8),
        FakeResult(3, [A], 9),
    ]
    ids = _ids(history)
    assert ids[1] == ids[2] and ids[3] == ids[4], ids  # a quorum that stays keeps its group
    distinct = [ids[0], ids[1], ids[3], ids[5], ids[6]]
    assert len(set(distinct)) == len(distinct), ids
    assert all(0 < i < 2**62 for i in ids)


def test_every_member_derives_the_same_id_whatever_it_saw_before() -> None:
    # A trained through two quorums before B (fresh, healing) joined the third: both see A+B
    # first in the same round, at the same max step, and so agree.
    a = _ids([FakeResult(1, [A], 0), FakeResult(2, [A], 3), FakeResult(3, [B, A], 7)])
    b = _ids([FakeResult(3, [A, B], 7), FakeResult(3, [A, B], 8)])
    assert a[2] == b[0] == b[1]


def test_the_lighthouse_id_is_kept_for_the_events() -> None:
    client = _QuorumClient(FakeLighthouse([FakeResult(4, [A, B], 2)]))
    assert client._quorum().quorum_id != 4
    assert client.lighthouse_quorum_id == 4 and client.last_quorum.max_step == 2


def test_a_member_that_missed_rounds_before_a_restart_drops_its_memo() -> None:
    # A and B in quorum 1; B misses rounds (a slow save) while A trains alone in quorum 2 for 3
    # steps; the lighthouse restarts and hands out quorum 1 = A+B again. B's memo of "1, A+B" is of
    # another quorum: both must derive the new one's id, not B its old one.
    a = _ids([FakeResult(1, [A, B], 4), FakeResult(2, [A], 5), FakeResult(2, [A], 6), FakeResult(1, [A, B], 8)])
    b = _ids([FakeResult(1, [A, B], 4), FakeResult(1, [A, B], 8)])
    assert a[3] == b[1] != b[0]


def test_a_member_that_saw_the_outage_drops_its_memo() -> None:
    # B's call failed while the lighthouse was down; the new lighthouse's "1, A+B" at the same step
    # is a new quorum for A too (A was in quorum 2 alone): they agree, on an id neither used.
    a = _ids([FakeResult(1, [A, B], 4), FakeResult(2, [A], 4), FakeResult(1, [A, B], 5)])
    b = _ids([FakeResult(1, [A, B], 4), None, FakeResult(1, [A, B], 5)])
    assert b[1] is None and a[2] == b[2] and a[2] not in (a[0], a[1])


class _Errored:
    original_exception = RuntimeError("Gloo connectFullMesh failed: Connection refused")


def _sync_with(inner_pg: object) -> ReplicaGroupSync:
    sync = object.__new__(ReplicaGroupSync)  # just the state _check_configured reads
    sync.group, sync.rank = 1, 0
    sync._manager = SimpleNamespace(_pg=SimpleNamespace(_pg=inner_pg), errored=lambda: _Errored())
    sync._client = _QuorumClient(FakeLighthouse([FakeResult(3, [A, B], 7)]))
    sync._client._quorum()
    return sync


def test_a_cross_group_mesh_that_could_not_be_built_restarts_the_group() -> None:
    _sync_with(inner_pg=object())._check_configured()  # built: nothing to do
    with pytest.raises(QuorumError, match=r"group 1 rank 0\] this rank's cross-group process group of quorum 3 could"):
        _sync_with(inner_pg=None)._check_configured()
