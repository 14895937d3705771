"""Quorum ids the Manager builds its cross-group process group under never repeat, even across a
lighthouse restart (which counts from 1 again), and every member of a quorum derives the same one."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from resilient.recovery.quorum import _QuorumClient

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
        return FakeResult(r.quorum_id, list(r.replica_ids), r.max_step)


def _ids(results: list[FakeResult]) -> list[int]:
    client = _QuorumClient(FakeLighthouse(list(results)))
    return [client._quorum().quorum_id for _ in results]


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
