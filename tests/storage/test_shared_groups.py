"""storage/shared.py across replica groups: each group's rank 0 leaves a token under the checkpoint
root and reads its quorum peers' tokens; a root a peer group does not share, or a peer group of this
job that made its own job secret (its run.dir is not shared), is refused in one line naming the
setting; a stranger that could not prove itself is not held against the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient.errors import ConfigError
from resilient.storage.objects import open_store
from resilient.storage.shared import check_group_tokens, remove_group_token, write_group_token
from resilient.storage.url import parse_url
from tests.tools.test_suggested_keys import KEY

pytestmark = pytest.mark.timeout(30)

G0, G1 = "group00000:a:uuid0", "group00001:b:uuid1"


def _store(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    return open_store(parse_url(str(path)))


def test_groups_sharing_the_root_see_each_other_and_leave_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt")
    write_group_token(store, 0, member=G0, job="job7", secret="s")
    write_group_token(store, 1, member=G1, job="job7", secret="s")
    check_group_tokens(store, 0, {1: (G1, True)}, job="job7", secret="s")
    check_group_tokens(store, 1, {0: (G0, True)}, job="job7", secret="s")
    # A newer start of group 1 (another member id) of the same job rewrote the token: still seen.
    check_group_tokens(store, 0, {1: ("group00001:b:uuid2", True)}, job="job7", secret="s")
    remove_group_token(store, 0)
    remove_group_token(store, 1)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_root_a_peer_group_writes_elsewhere_is_refused_naming_checkpoint_url(tmp_path: Path) -> None:
    here, there = _store(tmp_path / "node0"), _store(tmp_path / "node1")  # node-local roots
    write_group_token(here, 0, member=G0, job="job7", secret="s")
    write_group_token(there, 1, member=G1, job="job7", secret="s")
    for store, group, peer in ((here, 0, {1: (G1, True)}), (there, 1, {0: (G0, True)})):
        with pytest.raises(ConfigError) as refused:
            check_group_tokens(store, group, peer, job="job7", secret="s")
        line = str(refused.value)
        assert "\n" not in line and f"checkpoint.url={store.location.url} is not shared between the replica" in line
        assert f"does not see the file group(s) [{1 - group}] wrote there" in line
        assert "set checkpoint.url to a directory every node mounts" in line
        assert {m.group(0) for m in KEY.finditer(line)} == {"checkpoint.url"}


def test_a_peer_group_with_its_own_job_key_is_refused_naming_run_dir(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt")  # the root is shared, the run directories are not
    write_group_token(store, 1, member=G1, job="job7", secret="other")
    # Another secret: the member cannot prove itself in the quorum, but its token is this job's.
    with pytest.raises(ConfigError, match=r"replica group\(s\) \[1\] .* hold another job secret than group 0") as e:
        check_group_tokens(store, 0, {1: (G1, False)}, job="job7", secret="mine")
    assert "$RESILIENT_JOB_SECRET" in str(e.value) and "or run.dir to a directory every node mounts" in str(e.value)


def test_a_stranger_that_could_not_prove_itself_is_not_held_against_the_job(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt")
    check_group_tokens(store, 0, {1: ("group00001:x:evil", False)}, job="job7", secret="s")  # no token: ignored
    write_group_token(store, 1, member="group00001:x:evil", job="another", secret="x")
    check_group_tokens(store, 0, {1: ("group00001:x:evil", False)}, job="job7", secret="s")
