"""``ReplicatedTrainer._check_shared_root`` on a fake trainer: a quorum member may be anyone who
registered with the lighthouse, under any id. One whose id names no replica group is recorded and
skipped (no traceback, no restart loop), and a stranger calling itself a real group does not stand
in for that group's check of the shared checkpoint root."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from resilient.errors import ConfigError
from resilient.recovery.ownership import JOB_ID_ENV
from resilient.recovery.quorum import QuorumInfo
from resilient.runfiles import EventLog, read_events
from resilient.storage.objects import open_store
from resilient.storage.shared import write_group_token
from resilient.storage.url import parse_url
from resilient.trainer.replicated import ReplicatedTrainer

pytestmark = pytest.mark.timeout(30)

G0, G1 = "group00000:a:uuid0", "group00001:b:uuid1"


def _trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ReplicatedTrainer:
    monkeypatch.setenv(JOB_ID_ENV, "job7")
    (tmp_path / "ckpt").mkdir()
    trainer = ReplicatedTrainer.__new__(ReplicatedTrainer)
    trainer.group = 0
    trainer.sync = SimpleNamespace(replica_id=G0)
    trainer._seen_members = set()
    trainer._secret_fingerprint = "s"
    trainer.checkpointer = SimpleNamespace(store=open_store(parse_url(str(tmp_path / "ckpt"))))
    trainer.events = EventLog(str(tmp_path / "run"), enabled=True)
    return trainer


def _quorum(members: list[str], unproven: list[str]) -> QuorumInfo:
    return QuorumInfo(
        step=3,
        participating_rank=0,
        num_participants=len(members),
        quorum_id=1,
        members=members,
        healed=False,
        unproven=dict.fromkeys(unproven, "no proof of the job secret"),
    )


def test_a_member_id_that_names_no_group_is_recorded_and_skipped(tmp_path: Path, monkeypatch) -> None:
    trainer = _trainer(tmp_path, monkeypatch)
    write_group_token(trainer.checkpointer.store, 1, member=G1, job="job7", secret="s")
    for _ in range(2):  # asked again at the next step: recorded once
        trainer._check_shared_root(_quorum([G0, G1, "evil:uuid", "group-1:x", "group1_0:y"], ["evil:uuid"]))
    trainer.events.close()
    (event,) = [e for e in read_events(str(tmp_path / "run")) if e["event"] == "quorum_unproven"]
    assert sorted(event["members"]) == ["evil:uuid", "group-1:x", "group1_0:y"] and event["step"] == 4
    assert G1 in trainer._seen_members  # the real peer's token was read


def test_a_stranger_calling_itself_a_group_does_not_hide_that_groups_missing_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer(tmp_path, monkeypatch)
    # Group 1 (proven) left its token under another root; strangers name themselves group 1 too
    # (several: whatever order a set of member ids comes in, one of them came after the real one).
    strangers = [f"group00001:x:evil{i}" for i in range(20)]
    with pytest.raises(ConfigError, match=r"does not see the file group\(s\) \[1\] wrote there"):
        trainer._check_shared_root(_quorum([G0, G1, *strangers], strangers))
    assert G1 not in trainer._seen_members


def test_a_stranger_calling_itself_a_group_is_checked_beside_the_real_one(tmp_path: Path, monkeypatch) -> None:
    trainer = _trainer(tmp_path, monkeypatch)
    write_group_token(trainer.checkpointer.store, 1, member=G1, job="job7", secret="s")
    stranger = "group00001:x:evil"
    trainer._check_shared_root(_quorum([G0, G1, stranger], [stranger]))
    assert trainer._seen_members == {G1}  # the stranger is asked again while it stays unproven
