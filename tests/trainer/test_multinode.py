"""trainer/launching/multinode.py and the multi-node flags of ``resilient-train``: bad combinations are one
line and exit 2 before anything starts; the torchrun command joins a c10d rendezvous; and two
launchers on this machine (``--nnodes 2``, distinct ``RESILIENT_NODE_ID``) train one job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from resilient import Checkpointer
from resilient.dist import free_port
from resilient.errors import ConfigError
from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram import node_store_dir
from resilient.runfiles import iter_jsonl
from resilient.tools.train import main, parse_args
from resilient.trainer.launching.launch import ReplicaLaunch
from resilient.trainer.launching.multinode import Rendezvous, parse_nnodes, rendezvous_of, split_ranks
from resilient.trainer.launching.torchrun import torchrun_command
from resilient.trainer.observing.quiet import error_path
from tests.procs import communicate_or_fail, kill_tree
from tests.recovery.replica_checks import check_exactly_once

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
JOIN = ["--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7"]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_multinode_torchrun_command_joins_a_c10d_rendezvous() -> None:
    args = parse_args(["--nnodes", "2", "--node-rank", "1", *JOIN, "--config", TINY])
    args.nproc = 2  # what run_one_group puts there: ranks on this node
    command = torchrun_command(args)
    assert "--standalone" not in command and "--node-rank" not in command  # c10d ranks the nodes itself
    assert (_flag(command, "--nnodes"), _flag(command, "--rdzv-backend")) == ("2", "c10d")
    assert (_flag(command, "--rdzv-endpoint"), _flag(command, "--rdzv-id")) == ("node0:29400", "job7")
    assert _flag(command, "--rdzv-conf") == "is_host=0"  # node 0 hosts the store, not whoever binds first
    node0 = parse_args(["--nnodes", "2", "--node-rank", "0", *JOIN])
    node0.nproc = 2
    assert _flag(torchrun_command(node0), "--rdzv-conf") == "is_host=1"
    assert _flag(command, "--nproc-per-node") == "2" and _flag(command, "--max-restarts") == "3"
    assert command[command.index("-m", 3) :] == ["-m", "resilient.trainer", "--config", TINY]
    env = rendezvous_of(args).env()
    assert env["NODE_RANK"] == "1" and sorted(env) == ["NODE_RANK", "RESILIENT_LAUNCH_ID"]
    elastic = parse_args(["--nnodes", "1:4", *JOIN, "--max-restarts", "7"])
    elastic.nproc = 1
    command = torchrun_command(elastic)
    assert (_flag(command, "--nnodes"), _flag(command, "--max-restarts")) == ("1:4", "7")
    assert "--rdzv-conf" not in command  # no node rank: torchrun finds the host from HOST
    assert sorted(rendezvous_of(elastic).env()) == ["RESILIENT_LAUNCH_ID"]
    assert parse_args(["--nproc-per-node", "4"]).nnodes is None  # one node: the same as --nproc 4


def test_a_rerun_with_the_same_rdzv_id_is_not_silenced_by_the_last_ones_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one-error-line claim is keyed by torchrun's run id, here the operator's --rdzv-id.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.delenv("RESILIENT_LAUNCH_ID", raising=False)
    assert error_path(str(tmp_path)).endswith("error-job7")  # one node, standalone: as before
    first, second = (Rendezvous(min_nodes=2, max_nodes=2, endpoint="h:1", rdzv_id="job7", launch_id=i) for i in "ab")
    monkeypatch.setenv("RESILIENT_LAUNCH_ID", first.env()["RESILIENT_LAUNCH_ID"])
    claimed = error_path(str(tmp_path))
    monkeypatch.setenv("RESILIENT_LAUNCH_ID", second.env()["RESILIENT_LAUNCH_ID"])
    assert (claimed, error_path(str(tmp_path))) == (
        os.path.join(str(tmp_path), "logs", "error-job7-a"),
        os.path.join(str(tmp_path), "logs", "error-job7-b"),
    )


def test_nnodes_and_ranks_per_node() -> None:
    assert (parse_nnodes("3"), parse_nnodes("2:8")) == ((3, 3), (2, 8))
    for bad in ("0", "4:2", "a", "1:2:3", "-1", ""):
        with pytest.raises(ConfigError, match="--nnodes"):
            parse_nnodes(bad)
    assert split_ranks(8, 2, None, None) == 4 and split_ranks(8, 4, 2, 8) == 2
    with pytest.raises(ConfigError, match="do not split evenly over 3 nodes"):
        split_ranks(8, 3, None, None)
    with pytest.raises(ConfigError, match="--nnodes 2 x --nproc-per-node 2 = 4 ranks"):
        split_ranks(8, 2, 2, None)
    with pytest.raises(ConfigError, match="--nproc 6"):
        split_ranks(8, 2, None, 6)
    with pytest.raises(ConfigError, match="--node-rank 2 must be in"):
        Rendezvous(min_nodes=2, max_nodes=2, endpoint="h:1", rdzv_id="x", node_rank=2)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--node-rank", "0"], "--node-rank takes --nnodes N (or MIN:MAX) as well"),
        (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint takes --nnodes"),
        (["--rdzv-id", "x"], "--rdzv-id takes --nnodes"),
        (["--nproc", "2", "--nproc-per-node", "2"], "on one node --nproc and --nproc-per-node are the same"),
        (["--nnodes", "2"], "--nnodes 2 takes --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:29400"], "--nnodes 2 takes --rdzv-id ID"),
        (["--nnodes", "0", *JOIN], "--nnodes 0: need 1 <= MIN <= MAX"),
        (["--nnodes", "4:2", *JOIN], "--nnodes 4:2: need 1 <= MIN <= MAX"),
        (["--nnodes", "two", *JOIN], "--nnodes 'two' must be N or MIN:MAX"),
        (["--nnodes", "2", "--rdzv-endpoint", "h", "--rdzv-id", "x"], "--rdzv-endpoint 'h' must be HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:70000", "--rdzv-id", "x"], "port in 1..65535"),
        (["--nnodes", "2", "--node-rank", "2", *JOIN], "--node-rank 2 must be in [0, 2) for --nnodes 2"),
        (["--nnodes", "2:4", "--node-rank", "0", *JOIN], "elastic --nnodes 2:4 ranks the nodes at each rendezvous"),
    ],
)
def test_bad_flag_combinations_are_one_line_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("resilient-train: error: ") and says in lines[0], lines[0]


GROUPS = ["--replica-groups", "2", "--nproc-per-group", "1"]
LIGHTHOUSE_AT = ["--rdzv-endpoint", "node0:29510"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([*GROUPS, "--nnodes", "1:2", "--node-rank", "0", *LIGHTHOUSE_AT], "takes a fixed --nnodes N, not 1:2"),
        ([*GROUPS, "--nnodes", "3", "--node-rank", "0", *LIGHTHOUSE_AT], "--nnodes 3 but --replica-groups 2"),
        ([*GROUPS, "--nnodes", "2", *LIGHTHOUSE_AT], "takes --node-rank R: node R runs groups R, R+2, ..."),
        ([*GROUPS, "--nnodes", "2", "--node-rank", "2", *LIGHTHOUSE_AT], "--node-rank 2 must be in [0, 2)"),
        ([*GROUPS, "--nnodes", "2", "--node-rank", "1", *JOIN], "--replica-groups takes no --rdzv-id"),
        ([*GROUPS, "--nnodes", "2", "--node-rank", "1"], "take --rdzv-endpoint HOST:PORT (node 0 starts a lighthouse)"),
        ([*GROUPS, "--nnodes", "2", "--node-rank", "1", *LIGHTHOUSE_AT, "--lighthouse", "http://h:1"], "not both"),
    ],
)
def test_bad_replica_group_node_flags_are_one_line_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and says in lines[0], lines


def test_replica_groups_spread_over_nodes() -> None:
    def launch(nnodes: int, node_rank: int, **kwargs: object) -> ReplicaLaunch:
        values = {"groups": 5, "nproc_per_group": 1, "run_dir": "r", "trainer_args": [], **kwargs}
        return ReplicaLaunch(nnodes=nnodes, node_rank=node_rank, **values)

    assert [launch(2, rank).groups_here() for rank in (0, 1)] == [[0, 2, 4], [1, 3]]
    assert launch(1, 0).groups_here() == [0, 1, 2, 3, 4]  # one machine: all of them, as before
    with pytest.raises(ConfigError, match="--nnodes=6 is out of range"):
        launch(6, 0)
    with pytest.raises(ConfigError, match="--node-rank=2 is out of range"):
        launch(2, 2)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nnodes", "3", *JOIN], "4 ranks do not split evenly over 3 nodes"),
        (["--nnodes", "2", *JOIN, "--nproc-per-node", "4"], "--nnodes 2 x --nproc-per-node 4 = 8 ranks"),
        (["--nnodes", "2", *JOIN, "--nproc", "8"], "--nproc 8 but parallel.pp x dp_shard x tp = 4 ranks"),
    ],
)
def test_recipe_that_does_not_fit_the_nodes_is_one_line_exit_2(
    tmp_path: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*argv, "--config", TINY, "--set", f"run.dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert not (tmp_path / "run").exists()  # nothing started


def _node(rank: int, port: int, tmp_path: Path, *sets: str, hooks: tuple[str, ...] = ()) -> subprocess.Popen:
    """One launcher of a two-node job of one rank per node; its output goes to ``node<rank>.log``
    (files, not pipes: a launcher blocked on a full pipe would stall its peer in a collective)."""
    command = [sys.executable, "-m", "resilient.tools.train", "--config", TINY]
    command += ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    command += ["--rdzv-id", f"two-nodes-{port}"]
    keys = [
        "parallel.dp_shard=2",
        "parallel.tp=1",
        f"run.dir={tmp_path / 'run'}",
        f"checkpoint.url={tmp_path / 'ckpt'}",
    ]
    for key in [*keys, f"run.step_hooks={json.dumps([NODE_HOOK, *hooks])}", *sets]:
        command += ["--set", key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RESILIENT_NODE_ID": f"host-{'ab'[rank]}"}
    env.pop("NODE_RANK", None)
    env["RESILIENT_TEST_STEP_SLEEP"] = "0.3"  # read by PACE only
    with open(tmp_path / f"node{rank}.log", "a") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _wait_nodes(nodes: list[subprocess.Popen], tmp_path: Path, timeout_s: float) -> None:
    try:
        for rank, proc in enumerate(nodes):
            communicate_or_fail(proc, timeout_s, f"node {rank}")
    finally:
        for proc in nodes:
            if proc.poll() is None:
                kill_tree(proc)
    for rank, proc in enumerate(nodes):
        assert proc.returncode == 0, (tmp_path / f"node{rank}.log").read_text()[-4000:]


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_two_launchers_on_this_machine_are_two_nodes_of_one_job(tmp_path: Path) -> None:
    # ~20 s here: two resilient-train processes, one rank each, one c10d rendezvous on 127.0.0.1.
    port = free_port()
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    _wait_nodes([_node(rank, port, tmp_path, "run.steps=4") for rank in (0, 1)], tmp_path, 120)
    assert Checkpointer(str(ckpt)).steps() == [4]  # persist_every 4 in tiny.toml
    seen = [json.loads((run_dir / f"node-group0-rank{rank}.json").read_text()) for rank in (0, 1)]
    # One rank per launcher, each told the node it runs on; together one world of two.
    assert {s["RESILIENT_NODE_ID"] for s in seen} == {"host-a", "host-b"}
    for s in seen:
        assert s["NODE_RANK"] == str("ab".index(s["RESILIENT_NODE_ID"][-1]))  # from --node-rank
        assert (s["LOCAL_WORLD_SIZE"], s["WORLD_SIZE"], s["TORCHELASTIC_RUN_ID"]) == ("1", "2", f"two-nodes-{port}")
    assert sorted(s["GROUP_RANK"] for s in seen) == ["0", "1"]
    metrics = (run_dir / "group0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4]


def _group_node(rank: int, port: int, tmp_path: Path, ckpt: str = "ckpt", steps: int = 16) -> subprocess.Popen:
    command = [sys.executable, "-m", "resilient.tools.train", "--config", TINY, *GROUPS]
    command += ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    for key in ("parallel.dp_shard=1", "parallel.tp=1", f"run.steps={steps}", f"run.dir={tmp_path / 'run'}"):
        command += ["--set", key]
    hooks = json.dumps([PACE, NODE_HOOK])
    command += ["--set", f"checkpoint.url={tmp_path / ckpt}", "--set", f"run.step_hooks={hooks}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RESILIENT_NODE_ID": f"host-{rank}"}
    env["RESILIENT_TEST_STEP_SLEEP"] = "0.3"  # the groups' steps overlap: they meet in one quorum
    with open(tmp_path / f"node{rank}.log", "a") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


PACE = "tests.recovery.ram_hooks:pace"
NODE_HOOK = "tests.trainer.node_hooks:record_node"


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_replica_groups_on_two_launchers_share_node_0s_lighthouse(tmp_path: Path) -> None:
    # ~40 s here. One run directory for both "nodes", as on a shared file system.
    port = free_port()
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    nodes = [_group_node(0, port, tmp_path)]
    try:
        deadline = time.monotonic() + 90
        while not any(e["event"] == "lighthouse_started" for e in _events(run_dir)):
            assert nodes[0].poll() is None and time.monotonic() < deadline, "node 0 started no lighthouse"
            time.sleep(0.1)
        nodes.append(_group_node(1, port, tmp_path))
    except BaseException:
        kill_tree(nodes[0])
        raise
    _wait_nodes(nodes, tmp_path, 150)
    events = _events(run_dir)
    (lighthouse,) = [e for e in events if e["event"] == "lighthouse_started"]  # node 0's only
    assert lighthouse["url"] == f"http://127.0.0.1:{port}"
    assert sorted(e["group"] for e in events if e["event"] == "group_started") == [0, 1]
    assert {(e["group"], e["step"]) for e in events if e["event"] == "done"} == {(0, 16), (1, 16)}
    together = [e for e in events if e["event"] == "step" and e["committed"] and e["participants"] == 2]
    assert {e["group"] for e in together} == {0, 1}, [e for e in events if e["event"] == "step"][:4]
    assert Checkpointer(str(ckpt)).steps()[-1] == 16
    for group in (0, 1):  # group g ran on node g % 2, told so
        seen = json.loads((run_dir / f"node-group{group}-rank0.json").read_text())
        assert (seen["RESILIENT_NODE_ID"], seen["NODE_RANK"], seen["WORLD_SIZE"]) == (f"host-{group}", str(group), "1")


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "group0" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _published(store: Path, node: str, kind: str) -> set[int]:
    """Steps with a published (renamed, so complete) snapshot index under ``<node>/<kind>/rank*``
    (one rank per node here: its own snapshots, or the copies it keeps for the other node's rank)."""
    run_dir = str(store.parent / "run")  # the run.dir of ``_node``: the store is keyed by it
    directory = Path(node_store_dir(RamTierConfig(store_dir=str(store)), run_dir, 0, node))
    return {int(p.stem.split("-")[1]) for p in directory.glob(f"{kind}/rank*/step-*.json")}


def _replicated_past(store: Path, persisted: list[int]) -> int | None:
    """The newest step newer than every persistent checkpoint (and there is one) whose snapshot both
    nodes hold as their own AND as the other's buddy copy."""
    both = set.intersection(
        *(_published(store, node, kind) for node in ("host-a", "host-b") for kind in ("own", "buddy"))
    )
    return max((s for s in both if persisted and s > max(persisted)), default=None)


def _persisted(ckpt: Path) -> list[int]:
    return Checkpointer(str(ckpt)).steps() if ckpt.is_dir() else []  # none before the first commit


def _kill_node_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher, its torchrun and the workers, and wait until none of them is left (a
    worker still alive could write into the store the test is about to wipe)."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    kill_tree(proc)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_node_lost_with_its_memory_resumes_from_the_buddy_copies(tmp_path: Path) -> None:
    # Issue 14's acceptance test, ~55-75 s here. Node 1 (host-b) loses its whole process tree AND its RAM store, as a
    # machine that reboots would; node 0's torchrun restarts its worker into a new rendezvous round,
    # the relaunched node 1 joins it, and both resume from RAM: host-a's rank from its own snapshot,
    # host-b's from the copy host-a keeps for it. Persistent checkpoints every 5 steps only, so a
    # fallback to storage would show as an older step with storage reads.
    port = free_port()
    run_dir, ckpt, store = tmp_path / "run", tmp_path / "ckpt", tmp_path / "shm"
    sets = (
        "run.steps=12",
        "checkpoint.memory_every=2",
        "checkpoint.persist_every=5",
        "recovery.replication=true",
        "data.log_samples=true",
        f"recovery.store_dir={store}",
    )
    nodes = [_node(rank, port, tmp_path, *sets, hooks=(PACE,)) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while (replicated := _replicated_past(store, _persisted(ckpt))) is None:
            assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, "no replicated snapshot"
            time.sleep(0.05)
        # One step past the snapshot: the resumed job must redo it, on the very same samples.
        while _steps_done(run_dir) <= replicated:
            assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, "no step past the snapshot"
            time.sleep(0.05)
        _kill_node_tree(nodes[1])
        shutil.rmtree(node_store_dir(RamTierConfig(store_dir=str(store)), str(run_dir), 0, "host-b"))
        persisted, killed_after = _persisted(ckpt), _steps_done(run_dir)
        nodes[1] = _node(1, port, tmp_path, *sets, hooks=(PACE,))
    except BaseException:
        for proc in nodes:
            if proc.poll() is None:
                kill_tree(proc)
        raise
    _wait_nodes(nodes, tmp_path, 150)

    restores = [e for e in _events(run_dir) if e["event"] == "restore"]
    assert {(e["rank"], e["source"]) for e in restores[:2]} == {(0, "fresh"), (1, "fresh")}, restores
    resumed = restores[2:]
    # Which machine each rank ran on after the restart (node_hooks rewrites it at every start).
    node_of = {r: json.loads((run_dir / f"node-group0-rank{r}.json").read_text())["RESILIENT_NODE_ID"] for r in (0, 1)}
    sources = {node_of[e["rank"]]: e["source"] for e in resumed}
    assert len(resumed) == 2 and sources == {"host-a": "own", "host-b": "buddy"}, (node_of, resumed)
    assert [e["storage_reads"] for e in resumed] == [0, 0] and all(e["bytes"] > 0 for e in resumed), resumed
    (step,) = {e["step"] for e in resumed}  # one decision for every rank
    assert max(persisted) < step <= killed_after, (persisted, killed_after, resumed)
    assert Checkpointer(str(ckpt)).steps()[-1] == 12
    check_exactly_once(run_dir, 12, groups=1)
    # A step redone after the restore consumed the very samples it had before the kill.
    redone: dict[int, list[list[str]]] = {}
    for record in iter_jsonl(str(run_dir / "group0" / "samples.jsonl")):
        redone.setdefault(record["step"], []).append(record["sample_ids"])
    assert all(len({json.dumps(ids) for ids in runs}) == 1 for runs in redone.values()), redone


@pytest.mark.timeout(30)
def test_a_waiting_node_says_whom_it_waits_for_where_and_since_when(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from resilient.runfiles import write_pid
    from resilient.trainer.launching import multinode

    monkeypatch.setattr(multinode, "WAIT_REPORT_S", 0.0)
    wait = multinode.RendezvousWait(
        Rendezvous(min_nodes=2, max_nodes=2, endpoint="node0:29400", rdzv_id="job7", node_rank=1), str(tmp_path)
    )
    wait()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("waiting for 1 other node(s) of --nnodes 2 to join the rendezvous at node0:29400")
    assert "(--rdzv-id job7) since " in line and "start the same command on each of them" in line
    write_pid(str(tmp_path), 0, 0)  # a rank of this launch started: the rendezvous is complete
    wait()
    wait()
    assert capsys.readouterr().err == "" and wait.started


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_node_alone_at_the_rendezvous_is_not_silent(tmp_path: Path) -> None:
    proc = _node(0, free_port(), tmp_path)  # node 1 never comes
    log = tmp_path / "node0.log"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and "waiting for 1 other node(s)" not in log.read_text():
            time.sleep(0.5)
    finally:
        kill_tree(proc)
    lines = [line for line in log.read_text().splitlines() if line.startswith("waiting for")]
    assert lines and "to join the rendezvous at 127.0.0.1:" in lines[0], log.read_text()[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_a_checkpoint_root_each_node_sees_apart_is_refused_at_start_without_restarts(tmp_path: Path) -> None:
    # Each node's own directory, as a node-local path under each pod: refused before any save,
    # naming the setting, and torchrun does not restart the ranks into the same refusal.
    port = free_port()
    nodes = [_node(rank, port, tmp_path, f"checkpoint.url={tmp_path / f'ckpt-node{rank}'}") for rank in (0, 1)]
    for rank, proc in enumerate(nodes):
        communicate_or_fail(proc, 150, f"node {rank}")
    for rank, proc in enumerate(nodes):
        log = (tmp_path / f"node{rank}.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, log[-3000:]
        assert "is not shared between the ranks" in errors[0] and "set checkpoint.url to" in errors[0]
        assert log.count("failed (exitcode: 2)") <= 1, log[-3000:]  # no restart into the same error
    assert [p for rank in (0, 1) for p in (tmp_path / f"ckpt-node{rank}").glob("step-*")] == []


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_replica_groups_whose_checkpoint_roots_differ_are_refused(tmp_path: Path) -> None:
    # Each node's group writes to a root of its own (a node-local checkpoint.url): each group is
    # checked alone and passes; across the groups the roots differ, and both refuse in one line.
    port = free_port()
    nodes = [_group_node(0, port, tmp_path, ckpt="ckpt-node0", steps=300)]
    try:
        deadline = time.monotonic() + 90
        while not any(e["event"] == "lighthouse_started" for e in _events(tmp_path / "run")):
            assert nodes[0].poll() is None and time.monotonic() < deadline, "node 0 started no lighthouse"
            time.sleep(0.1)
        nodes.append(_group_node(1, port, tmp_path, ckpt="ckpt-node1", steps=300))
        for rank, proc in enumerate(nodes):
            communicate_or_fail(proc, 150, f"node {rank}")
    finally:
        for proc in nodes:
            if proc.poll() is None:
                kill_tree(proc)
    for rank, proc in enumerate(nodes):
        log = (tmp_path / f"node{rank}.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, log[-3000:]
        assert "is not shared between the replica groups" in errors[0], errors
        assert "set checkpoint.url to a directory every node mounts" in errors[0], errors
    starts = [e for e in _events(tmp_path / "run") if e["event"] == "joining"]
    assert sorted((e["group"], e["attempt"]) for e in starts) == [(0, 0), (1, 0)], starts  # no restart into it
