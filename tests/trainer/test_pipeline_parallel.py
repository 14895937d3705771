"""Pipeline stages and schedules against the unpipelined model, on 4 real gloo ranks.

pp=2 x dp_shard=2 (FSDP2 inside each stage): every rank builds its stages with ``build_stages``
from the tiny recipe (4 layers), runs one ``Stages.step`` on its share of a synthetic global batch,
and compares with one process running the whole model: the summed microbatch losses and every
parameter's gradient under both schedules, and a bf16 + activation-checkpointing step that stays
close to fp32 with fp32 gradients.
"""

from __future__ import annotations

import pytest
import torch

from resilient.dist import all_gather_json
from resilient.errors import ConfigError
from resilient.trainer.config import load_config
from resilient.trainer.model import OmniModel, count_loss_tokens, synthetic_batch
from resilient.trainer.parallel_config import ParallelConfig
from resilient.trainer.pipeline_parallel import rank_stages, stage_layers
from tests.dist import run_world
from tests.trainer.e2e_runs import TINY

ROWS, SEQ = 8, 64  # data.global_rows of the tiny recipe: 4 rows per data-parallel rank
PIPELINED = ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=1", "model.n_layers=4", f"data.row_len={SEQ}"]
CASES = {
    "1F1B": ('parallel.pp_schedule="1F1B"', "parallel.pp_microbatches=2"),
    "interleaved1F1B": ('parallel.pp_schedule="interleaved1F1B"', "parallel.pp_microbatches=2"),
    "bf16+checkpointing": ('parallel.mixed_precision="bf16"', 'parallel.activation_checkpointing="full"'),
}


def _reference(config) -> dict:
    model = OmniModel(config.model, seed=config.run.seed)
    batch = synthetic_batch(config.model, batch_size=ROWS, seq_len=SEQ, seed=3)
    out = model(batch)
    out.loss.backward()
    return {"batch": batch, "loss": out.loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _pipelined_steps(rank: int, world: int) -> dict:
    """Every case on this rank of a pp=2 x dp_shard=2 world: one step each against the reference."""
    from resilient.trainer.parallelize import build_mesh

    torch.set_num_threads(1)
    mesh = build_mesh(2, 1, pp=2)
    return {name: _one_step(load_config(TINY, [*PIPELINED, *extra]), mesh) for name, extra in CASES.items()}


def _one_step(config, mesh) -> dict:
    from torch.distributed.tensor import DTensor

    from resilient.trainer.build import build_stages

    ref = _reference(config)
    model = OmniModel(config.model, seed=config.run.seed)
    stages, global_params = build_stages(config, model, mesh, torch.device("cpu"))
    share = ROWS // 2
    start = mesh["dp_shard"].get_local_rank() * share
    local = {key: value[start : start + share] for key, value in ref["batch"].items()}
    outs = stages.step(local, count_loss_tokens(ref["batch"]))  # normalized by the GLOBAL count
    loss = torch.tensor(sum(o.loss.item() for o in outs), dtype=torch.float64)
    torch.distributed.all_reduce(loss)  # over dp_shard and pp: only the last stage holds losses
    gaps, dtypes = {}, set()
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        dtypes.add(str(grad.dtype))
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), ref["grads"][name].flatten(), dim=0)
        gaps[name] = [(grad - ref["grads"][name]).abs().max().item(), cosine.item()]
    held = all_gather_json(sorted(gaps))
    return {
        "loss": loss.item(),
        "ref_loss": ref["loss"],
        "grad_gaps": gaps,
        "names_held": held,
        "global_names": list(global_params),
        "dtypes": sorted(dtypes),
        "outputs": len(outs),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(_pipelined_steps, 4, timeout_s=240)


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["1F1B", "interleaved1F1B"])
def test_pipelined_step_matches_the_whole_model(results: list[dict], case: str) -> None:
    for rank, by_case in enumerate(results):
        r = by_case[case]
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
        for name, (gap, _) in r["grad_gaps"].items():
            assert gap <= 1e-5, (rank, name, gap)
        # Ranks 0, 1 (pp 0) and 2, 3 (pp 1) hold each parameter of the model under its global name,
        # every parameter on exactly one stage.
        stage0, stage1 = set(r["names_held"][0]), set(r["names_held"][2])
        assert r["names_held"][0] == r["names_held"][1] and r["names_held"][2] == r["names_held"][3]
        assert not stage0 & stage1 and sorted(stage0 | stage1) == sorted(r["global_names"])
    # The last stage returns one output per microbatch, the first none.
    assert [by_case[case]["outputs"] for by_case in results] == [0, 0, 2, 2]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_pipelined_step_in_bf16_with_activation_checkpointing(results: list[dict]) -> None:
    for by_case in results:
        r = by_case["bf16+checkpointing"]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=2e-2)
        assert r["dtypes"] == ["torch.float32"]  # master weights and reduced gradients stay fp32
        assert all(cosine > 0.98 for _, cosine in r["grad_gaps"].values()), r["grad_gaps"]


def test_stage_split_and_placement() -> None:
    assert stage_layers(4, 2) == [["0", "1"], ["2", "3"]]
    assert stage_layers(5, 2) == [["0", "1", "2"], ["3", "4"]]
    assert stage_layers(4, 4) == [["0"], ["1"], ["2"], ["3"]]
    with pytest.raises(ConfigError, match="3 pipeline stages need at least 3 layers"):
        stage_layers(2, 3)
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved1F1B")
    assert [rank_stages(interleaved, r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert rank_stages(ParallelConfig(pp=2), 1) == [1]
