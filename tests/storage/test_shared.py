"""storage/shared.py: a checkpoint root that is not the same place for every rank is refused at
start, on every rank alike, naming the setting; a shared one passes and keeps nothing."""

from __future__ import annotations

import os

import pytest

from tests.dist import outcome, run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _check(rank: int, world: int, root: str, per_rank: bool) -> tuple[str, list[str]]:
    from resilient.storage.objects import open_store
    from resilient.storage.shared import check_shared_root
    from resilient.storage.url import parse_url

    # per_rank: each rank's own directory, as a node-local path on each of several nodes
    path = os.path.join(root, f"node{rank}") if per_rank else root
    store = open_store(parse_url(path))
    said = outcome(lambda: check_shared_root(store, setting="checkpoint.url"))
    return said, sorted(os.listdir(path)) if os.path.isdir(path) else []


def test_a_root_each_rank_sees_differently_is_refused_on_every_rank(tmp_path) -> None:
    results = run_world(_check, 2, str(tmp_path), True)
    (said, _), (said_1, listing_1) = results
    assert said == said_1, "every rank raises the same error"
    assert said.startswith(f"ConfigError: checkpoint.url={tmp_path}/node0 is not shared between the ranks: rank(s) [1]")
    assert "set checkpoint.url to a directory every node mounts" in said
    assert listing_1 == []  # rank 1 wrote nothing under its own root


def test_a_shared_root_passes_and_keeps_no_token(tmp_path) -> None:
    results = run_world(_check, 2, str(tmp_path), False)
    assert [said for said, _ in results] == ["ok", "ok"]
    assert os.listdir(tmp_path) == []
