"""The cadence keys of [checkpoint]: defaults, and one-line errors naming the key."""

from __future__ import annotations

import pytest

from resilient.errors import ConfigError
from resilient.trainer.cadence_model import LLAMA3_NODE_MTBF_S
from resilient.trainer.config import load_config

pytestmark = pytest.mark.timeout(60)


def test_defaults_are_fixed_with_the_llama3_prior():
    c = load_config(None).checkpoint
    assert (c.cadence, c.max_loss_s, c.mtbf_prior_s) == ("fixed", 0.0, LLAMA3_NODE_MTBF_S)
    assert c.memory_every_range == [1, 10_000] and c.persist_every_range == [1, 100_000]


def test_adaptive_keys_load():
    c = load_config(
        None,
        [
            "checkpoint.cadence='adaptive'",
            "checkpoint.memory_every=4",
            "checkpoint.memory_every_range=[2, 8]",
            "checkpoint.persist_every_range=[10, 100]",
            "checkpoint.max_loss_s=600",
            "checkpoint.mtbf_prior_s=3600",
        ],
    ).checkpoint
    assert (c.cadence, c.memory_every_range, c.persist_every_range) == ("adaptive", [2, 8], [10, 100])
    assert (c.max_loss_s, c.mtbf_prior_s) == (600.0, 3600.0)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["checkpoint.cadence='sometimes'"], "checkpoint.cadence"),
        (["checkpoint.memory_every_range=[5]"], "checkpoint.memory_every_range"),
        (["checkpoint.persist_every_range=[0, 10]"], "checkpoint.persist_every_range[0]"),
        (["checkpoint.persist_every_range=[100, 10]"], "min is above max"),
        (["checkpoint.cadence='adaptive'", "checkpoint.persist_every_range=[100, 200]"], "checkpoint.persist_every=50"),
        (["checkpoint.max_loss_s=60"], "needs checkpoint.cadence='adaptive'"),
        (["checkpoint.max_loss_s=-1", "checkpoint.cadence='adaptive'"], "checkpoint.max_loss_s"),
        (["checkpoint.mtbf_prior_s=0"], "checkpoint.mtbf_prior_s"),
        (["checkpoint.mtbf_prior_s='a day'"], "checkpoint.mtbf_prior_s"),
    ],
)
def test_bad_cadence_keys_give_one_line_errors(overrides: list[str], names: str):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert names in message and "\n" not in message
