"""A RAM-tier node is a machine, not a rank range (``recovery/ram/node_id.py``, ``pairing.py``):
its identity comes from the environment, the pairing from the sorted identities, and a restart
that renumbers the ranks still restores from RAM."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from resilient.errors import ConfigError
from resilient.recovery.ram import node_id
from resilient.recovery.ram.node_id import resolve_node_id, sanitize
from resilient.recovery.ram.pairing import Pairing
from resilient.recovery.ram.restore import choose_step
from resilient.recovery.ram.store import run_dir_key
from tests.dist import run_world
from tests.recovery.ram import node_workers

pytestmark = pytest.mark.timeout(180)


@pytest.mark.timeout(10)
def test_identity_order_prefers_the_override_then_pod_then_slurm_node_then_host_name(monkeypatch):
    monkeypatch.setattr(node_id.socket, "gethostname", lambda: "host-7")
    env = {
        "RESILIENT_NODE_ID": "rack2-n5",
        "POD_NAME": "train-worker-1",
        "SLURMD_NODENAME": "gpu017",
        "NODE_RANK": "3",
        "SLURM_NODEID": "1",
    }
    assert resolve_node_id(env) == ("rack2-n5", "RESILIENT_NODE_ID")
    del env["RESILIENT_NODE_ID"]
    assert resolve_node_id(env) == ("train-worker-1", "POD_NAME")
    env["POD_NAME"] = "  "  # blank: not set
    assert resolve_node_id(env) == ("gpu017", "SLURMD_NODENAME")
    del env["SLURMD_NODENAME"]
    # NODE_RANK and SLURM_NODEID are positions a rendezvous renumbers: never an identity.
    assert resolve_node_id(env) == ("host-7", "hostname")


@pytest.mark.timeout(10)
def test_sanitized_names_are_path_components_and_stay_distinct():
    assert sanitize("gpu017.cluster") == "gpu017.cluster"
    odd = [sanitize(name) for name in ("a/b", "a:b", "a_b", "..", "x" * 100)]
    assert odd[2] == "a_b" and len(set(odd)) == 5
    assert all("/" not in name and name not in ("", ".", "..") and len(name) <= 73 for name in odd)
    assert odd[0].startswith("a_b-") and odd[1].startswith("a_b-") and odd[0] != odd[1]


@pytest.mark.timeout(10)
def test_pairing_comes_from_the_sorted_identities_whatever_the_rank_order():
    # Ranks interleaved over three machines: node n is the n-th sorted identity.
    pairing = Pairing.from_identities(["h2", "h0", "h1", "h0", "h2", "h1"])
    assert pairing.node_names == ("h0", "h1", "h2") and pairing.ranks_per_node == 2
    assert [pairing.node_of(r) for r in range(6)] == [2, 0, 1, 0, 2, 1]
    assert [pairing.ranks_on(n) for n in range(3)] == [[1, 3], [2, 5], [0, 4]]
    # Same local index on the next node of the ring: h0 -> h1 -> h2 -> h0.
    assert [pairing.buddy_of(r) for r in range(6)] == [1, 2, 0, 5, 3, 4]
    assert pairing.kept_by(0) == [2] and pairing.kept_by(1) == [0]
    # Two nodes that swapped rank numbers keep the same buddies (by machine, not by rank).
    before, after = Pairing.from_identities(["a", "b"]), Pairing.from_identities(["b", "a"])
    assert (before.node_of(0), after.node_of(1)) == (0, 0) and after.buddy_of(1) == 0
    racks = Pairing.from_identities(["n3", "n1", "n2", "n0"], failure_domains=("x", "x", "y", "y"))
    # nodes n0 n1 (rack x), n2 n3 (rack y): each buddy is the next node in the other rack
    assert [racks.buddy_of(r) for r in range(4)] == [3, 2, 3, 2]


@pytest.mark.timeout(10)
def test_unequal_rank_counts_per_node_are_one_line_naming_the_counts():
    with pytest.raises(ConfigError) as info:
        Pairing.from_identities(["b", "a", "a", "c", "c", "c"])
    message = str(info.value)
    assert "\n" not in message and "a=2, b=1, c=3" in message


@pytest.mark.timeout(10)
def test_a_step_counts_when_any_rank_offers_the_copy_not_only_the_current_buddy():
    # After a renumbering, rank 0's step 4 lies on rank 2's node (its buddy then), while its buddy
    # now is rank 1: the step is still every rank's.
    reports = [
        {"own": [2], "kept": {"2": [2, 4]}},
        {"own": [2, 4], "kept": {"0": [2]}},
        {"own": [2, 4], "kept": {"0": [4], "1": [2, 4]}},
    ]
    assert choose_step(reports, set()) == 4
    assert choose_step(reports, {4}) == 2


def _index(node_dir: str, kind: str, rank: int, step: int) -> dict:
    with open(os.path.join(node_dir, kind, f"rank{rank}", f"step-{step:09d}.json")) as f:
        return json.load(f)


@pytest.mark.dist
def test_restore_after_the_two_nodes_swapped_rank_numbers(tmp_path):
    base = str(tmp_path)
    taken = run_world(node_workers.snapshot_on, 2, base, ["alpha", "beta"], [2, 4], timeout_s=120)
    assert [t["node_id"] for t in taken] == ["alpha", "beta"] and [t["buddy"] for t in taken] == [1, 0]
    assert all(t["copies"] == ["copied", "copied"] for t in taken)
    alpha, beta = taken[0]["node_dir"], taken[1]["node_dir"]
    key = run_dir_key(os.path.join(base, "run"))  # stores are keyed by run under any store_dir
    assert alpha == os.path.join(base, "alpha", key, "group0", "node-alpha")  # keyed by identity, not index
    own = _index(alpha, "own", 0, 4)
    assert (own["rank"], own["node_id"], own["local_rank"], own["step"]) == (0, "alpha", 0, 4)
    assert _index(beta, "buddy", 0, 4)["node_id"] == "alpha"  # the copy says whose it is
    # The rendezvous renumbers: machine beta now runs rank 0, alpha rank 1. Each rank's snapshot
    # (its shard: values rank*1000+step) lies on the machine it now runs on, as the buddy copy.
    restored = run_world(node_workers.restore_on, 2, base, ["beta", "alpha"], timeout_s=120)
    for rank, r in enumerate(restored):
        assert (r["step"], r["source"], r["sources"]) == (4, "own", ["own", "own"]), r
        assert r["w"] == r["b"] == rank * 1000 + 4 and r["train"] == {"step": 4, "rank": rank}


@pytest.mark.dist
def test_restore_after_a_swap_fetches_from_the_other_node_when_this_one_lost_its_memory(tmp_path):
    base = str(tmp_path)
    run_world(node_workers.snapshot_on, 2, base, ["alpha", "beta"], [2, 4], timeout_s=120)
    shutil.rmtree(os.path.join(base, "beta"))  # beta was rebooted: its RAM is empty
    restored = run_world(node_workers.restore_on, 2, base, ["beta", "alpha"], timeout_s=120)
    # Rank 0 now runs on the empty beta: its own snapshot was left on alpha, fetched over the
    # channel. Rank 1 on alpha reads the copy alpha kept for it, in place.
    assert [(r["step"], r["source"]) for r in restored] == [(4, "buddy"), (4, "own")]
    for rank, r in enumerate(restored):
        assert r["sources"] == ["buddy", "own"]
        assert r["w"] == r["b"] == rank * 1000 + 4 and r["train"] == {"step": 4, "rank": rank}


@pytest.mark.dist
def test_nodes_with_unequal_rank_counts_fail_to_start_on_every_rank(tmp_path):
    results = run_world(node_workers.start_on, 3, str(tmp_path), ["a", "a", "b"], timeout_s=120)
    assert [r["type"] for r in results] == ["ConfigError"] * 3
    assert all("a=2, b=1" in r["message"] and "\n" not in r["message"] for r in results)


def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


@pytest.mark.dist
def test_stores_a_swap_left_behind_drop_their_abandoned_snapshots(tmp_path):
    base = str(tmp_path)
    run_world(node_workers.snapshot_on, 2, base, ["alpha", "beta"], [2, 4], "0-old", timeout_s=120)
    key = run_dir_key(os.path.join(base, "run"))
    beta = os.path.join(base, "beta", key, "group0", "node-beta")
    # keep=2: two visible, and the tier readies two more slots (one for a copy overlapping the
    # previous one's replication) off the training thread.
    assert _files(os.path.join(beta, "own", "rank1")) == [f"slot{k}.bin" for k in range(4)] + [
        f"step-{s:09d}.json" for s in (2, 4)
    ]
    # Swapped, and the run went on in a new timeline (e.g. restored from storage): nothing will
    # ever publish into beta's own/rank1 or buddy/rank0 again, and their snapshots can never restore.
    run_world(node_workers.snapshot_on, 2, base, ["beta", "alpha"], [6], "1-new", timeout_s=120)
    alpha = os.path.join(base, "alpha", key, "group0", "node-alpha")
    for left in (os.path.join(beta, "own", "rank1"), os.path.join(beta, "buddy", "rank0")):
        assert _files(left) == [], left
    for left in (os.path.join(alpha, "own", "rank0"), os.path.join(alpha, "buddy", "rank1")):
        assert _files(left) == [], left
    # What the new timeline wrote stays: each rank's step 6 and its copy on the other machine.
    for node, rank, kind in ((beta, 0, "own"), (alpha, 1, "own"), (alpha, 0, "buddy"), (beta, 1, "buddy")):
        index = _index(node, kind, rank, 6)
        assert (index["rank"], index["timeline"], index["step"]) == (rank, "1-new", 6)
        slots = [f"slot{k}.bin" for k in range(4 if kind == "own" else 1)]  # own: readied ahead
        assert _files(os.path.join(node, kind, f"rank{rank}")) == [*slots, "step-000000006.json"]


@pytest.mark.dist
def test_restore_after_two_machines_of_two_ranks_were_interleaved_by_the_rendezvous(tmp_path):
    base = str(tmp_path)
    taken = run_world(node_workers.snapshot_on, 4, base, ["a", "a", "b", "b"], [2, 4], timeout_s=150)
    assert [t["buddy"] for t in taken] == [2, 3, 0, 1] and all(t["copies"] == ["copied"] * 2 for t in taken)
    # Now machine b runs ranks 0 and 2, machine a ranks 1 and 3: each rank's step 4 lies on the
    # machine it runs on (its own store, or the copy kept there for it), read in place.
    restored = run_world(node_workers.restore_on, 4, base, ["b", "a", "b", "a"], timeout_s=150)
    for rank, r in enumerate(restored):
        assert (r["step"], r["sources"]) == (4, ["own"] * 4), r
        value = rank * 1000 + 4
        assert r["w"] == value and r["b"] == float(torch.tensor(value).bfloat16()), r
        assert r["train"] == {"step": 4, "rank": rank}
