"""Only members that hold the job secret contribute to a quorum (``recovery/quorum_auth.py``).

Before: anyone who reached the lighthouse's port could register as a replica group and join the
cross-group gradient all-reduce (a SUM), or take participating rank 0.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from resilient.dist import free_port
from resilient.recovery.config import ReplicaConfig
from resilient.recovery.quorum import ReplicaGroupSync
from resilient.recovery.quorum_auth import MemberCheck, member_id, proof_address
from resilient.recovery.transport import HealTransport
from resilient.trainer.launching.lighthouse import interface_of, kill_group, start_lighthouse

REPO = Path(__file__).resolve().parents[2]
SECRET, OTHER = b"s" * 32, b"o" * 32


def _transport(secret: bytes, replica_id: str) -> HealTransport:
    transport = HealTransport(secret, rank=0, host="127.0.0.1", timeout=timedelta(seconds=5))
    transport.replica_id = replica_id
    transport.store_address = "127.0.0.1:29500"
    return transport


@pytest.mark.timeout(30)
def test_a_member_id_names_where_it_proves_itself():
    for host in ("127.0.0.1", "::1", "node-7.cluster"):
        member = f"{member_id(12, host, 4567)}:9f1c-uuid"
        assert member.split(":")[0] == "group00012" and proof_address(member) == (host, 4567)
    assert member_id(3, "h", 1).endswith(".g3")  # torchft reads the global rank from trailing digits
    assert proof_address("group00001:0b6f-uuid") is None and proof_address("group00001:auth.%%.g1:x") is None


@pytest.mark.timeout(30)
def test_only_members_that_hold_the_secret_are_proven():
    real = _transport(SECRET, "")
    real.replica_id = f"{member_id(1, *real.address)}:u1"
    stranger = _transport(OTHER, "")
    stranger.replica_id = f"{member_id(2, *stranger.address)}:u2"
    try:
        check = MemberCheck(SECRET, rank=0, timeout_s=5)
        posing = f"{member_id(3, *real.address)}:u3"  # names a real group's server as its own
        own = "group00000:mine"
        unproven = check.unproven([own, real.replica_id, stranger.replica_id, posing, "group00004:u4"], own)
        assert sorted(unproven) == sorted([stranger.replica_id, posing, "group00004:u4"])
        assert "no proof of the job secret from 127.0.0.1" in unproven[stranger.replica_id]
        assert unproven[posing].endswith(f"proves the job secret for {real.replica_id!r}, not for this member")
        assert "names no place" in unproven["group00004:u4"]
        assert stranger.rejected  # the stranger's server saw our handshake fail too
    finally:
        real.shutdown()
        stranger.shutdown()


@pytest.mark.timeout(30)
def test_a_proof_holds_for_the_member_and_the_store_it_registered():
    real = _transport(SECRET, "")
    real.replica_id = f"{member_id(1, *real.address)}:u1"
    real.store_address = "10.0.0.1:29500"
    try:
        check = MemberCheck(SECRET, rank=0, timeout_s=5)
        assert check.unproven(["group00000:mine", real.replica_id], "group00000:mine") == {}
        assert check.stores([real.replica_id]) == ["10.0.0.1:29500"] and check.stores(["other"]) == []
        real.store_address = ""  # a server that names no store proves nothing
        assert (
            "names no store"
            in MemberCheck(SECRET, rank=0, timeout_s=5).unproven([real.replica_id], "")[real.replica_id]
        )
    finally:
        real.shutdown()


class _Manager:
    def __init__(self) -> None:
        self.reported: list[Exception] = []

    def errored(self) -> Exception | None:
        return self.reported[0] if self.reported else None

    def report_error(self, e: Exception) -> None:
        self.reported.append(e)


@pytest.mark.timeout(30)
def test_a_quorum_meeting_at_a_store_no_proven_member_registered_is_refused():
    # Before: a stranger re-registering under a real member's id, with its own store, passed the
    # proof (asked of the real member's server) and hosted the cross-group rendezvous.
    sync = ReplicaGroupSync.__new__(ReplicaGroupSync)
    sync.group, sync.rank, sync._manager = 0, 0, _Manager()
    sync._unproven, sync._stores, sync._store_refused = {}, ["10.0.0.1:29500", "10.0.0.2:29500"], {}
    sync._check_store("10.0.0.2:29500")
    assert sync._store_refused == {} and sync._manager.reported == []
    sync._check_store("6.6.6.6:1")
    assert list(sync._store_refused) == ["store 6.6.6.6:1"] and len(sync._manager.reported) == 1
    assert sync.allreduce_sum(torch.ones(2)) is False  # nothing crosses groups
    sync._check_store("10.0.0.1:29500")  # a later quorum at a proven store is fine again
    assert sync._store_refused == {}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_stranger_that_joins_the_quorum_gets_nothing_and_nothing_commits(tmp_path, monkeypatch):
    port = free_port()
    with open(tmp_path / "lighthouse.log", "w") as log:
        lighthouse = start_lighthouse(port, log, join_timeout_ms=60000, heartbeat_timeout_ms=5000, min_replicas=2)
    url = f"http://127.0.0.1:{port}"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    stranger = subprocess.Popen(
        [sys.executable, "-m", "tests.recovery.quorum_stranger", url, "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sync = None
    try:
        config = ReplicaConfig(enabled=True, groups=2, lighthouse=url, quorum_timeout_s=60, timeout_s=10)
        sync = ReplicaGroupSync(
            config,
            group=0,
            rank=0,
            world_size=1,
            state_dict=lambda: {},
            load_state_dict=lambda state: None,
            secret=SECRET,
            host="127.0.0.1",
        )
        quorum = sync.start_step()
        assert quorum.num_participants == 2 and len(quorum.members) == 2
        ((member, reason),) = quorum.unproven.items()
        assert member.startswith("group00001:") and "names no place" in reason
        grad = torch.ones(4)
        assert sync.allreduce_sum(grad) is False and grad.tolist() == [1.0] * 4  # nothing crossed
        assert sync.should_commit() is False
        assert sync.current_step() == 0
        out, _ = stranger.communicate(timeout=120)
        # Its one round (a second would only wait out its quorum timeout: group 0 asks no more).
        rounds = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert stranger.returncode == 0 and rounds == [{"participants": 2, "commit": False}], out[-2000:]
    finally:
        if sync is not None:
            sync.shutdown()
        if stranger.poll() is None:
            stranger.kill()
        kill_group(lighthouse)


@pytest.mark.timeout(90)
def test_the_lighthouse_listens_on_the_jobs_interface_only(tmp_path):
    # Before: across nodes it bound 0.0.0.0, reachable on every interface of node 0.
    assert interface_of("127.0.0.2:29500") == "127.0.0.2" and interface_of("localhost:1") == "127.0.0.1"
    assert interface_of("[::1]:29500") == "::1"
    port = free_port("127.0.0.2")
    with open(tmp_path / "lighthouse.log", "w") as log:
        lighthouse = start_lighthouse(
            port, log, join_timeout_ms=1000, heartbeat_timeout_ms=1000, bind=interface_of(f"127.0.0.2:{port}")
        )
    try:
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        kill_group(lighthouse)
