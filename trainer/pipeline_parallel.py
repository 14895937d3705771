"""Pipeline parallelism: the omni model cut into stages and run by a ``torch.distributed.pipelining``
schedule (1F1B, interleaved 1F1B), beside ``parallelize`` as torchtitan keeps ``pipeline_llm``
beside its model.

The split, on the ``pp`` ranks of a replica group (each a ``dp_shard x tp`` mesh of its own):

- every rank builds the whole model from the seed, then drops what its stages do not run
  (``prune_to_stages``): what is left is this rank's *rank model*, an ``OmniModel`` holding some
  blocks (under their global keys "0", "1", ...) and, on the first and last stage, the embeddings or
  the heads; its parameter names are the full model's, so checkpoints and the optimizer see global
  FQNs whatever the split;
- each stage is an ``OmniStage``: a view that registers the rank model's modules of that stage under
  the same names (so the stage's FSDP root and tensor-parallel plan address them as in the full
  model) and runs them through the model's own ``embed`` / ``run_blocks`` / ``head_loss``;
- stages hand the residual stream on as a plain tensor; every stage gets its microbatch of the batch
  as keyword arguments (positions and document ids for the mask, targets for the last stage's loss),
  which the schedule splits along rows exactly as it splits the first stage's input.

The last stage returns each microbatch's loss, already divided by the GLOBAL loss-token count the
trainer sets before the step (``loss_normalizer``); the schedule then sums gradients over
microbatches (``scale_grads=False``), so the pipeline computes the same gradient as one pass over the
whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from resilient.errors import ConfigError
from resilient.trainer.model import OmniModel, OmniOutput
from resilient.trainer.parallel_config import ParallelConfig

INPUT_MODULES = ("tok_embeddings", "modality_embeddings", "audio_proj", "video_proj")
"""What the first stage runs before its blocks (``OmniModel.embed``)."""
OUTPUT_MODULES = ("norm", "text_head", "audio_head", "video_head")
"""What the last stage runs after its blocks (``OmniModel.head_loss``)."""


def stage_layers(n_layers: int, num_stages: int) -> list[list[str]]:
    """Block keys of each stage: contiguous runs, sizes differing by at most one (earlier stages
    take the remainder: the last stage also runs the heads)."""
    if num_stages > n_layers:
        raise ConfigError(f"{num_stages} pipeline stages need at least {num_stages} layers, the model has {n_layers}")
    base, extra = divmod(n_layers, num_stages)
    keys, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        keys.append([str(i) for i in range(start, start + size)])
        start += size
    return keys


def rank_stages(config: ParallelConfig, pp_rank: int) -> list[int]:
    """Stage indices this pp rank runs: one for 1F1B; for interleaved 1F1B, ``pp_rank + k*pp``
    (the loop placement ``ScheduleInterleaved1F1B`` expects)."""
    return [pp_rank + k * config.pp for k in range(config.stages_per_rank)]


def prune_to_stages(model: OmniModel, layers: list[list[str]], stages: Sequence[int]) -> None:
    """Drop, in place, every module of ``model`` that none of ``stages`` runs (their memory is freed
    with them); the first stage keeps the input modules, the last the output modules."""
    keep = {key for stage in stages for key in layers[stage]}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if 0 not in stages:
        for name in INPUT_MODULES:
            setattr(model, name, None)
    if len(layers) - 1 not in stages:
        for name in OUTPUT_MODULES:
            setattr(model, name, None)


class OmniStage(nn.Module):
    """One pipeline stage of a rank model: its modules under their global names, run in order.

    The rank model is held outside the module tree (``object.__setattr__``): registering it would
    prefix every name with its attribute name, and it holds the other stage's blocks on a rank with
    two stages. Its methods only touch the modules passed to them or registered here.
    """

    def __init__(self, model: OmniModel, layer_keys: list[str], *, first: bool, last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        self.config = model.config
        self.is_first, self.is_last = first, last
        for name in INPUT_MODULES if first else ():
            self.add_module(name, getattr(model, name))
        self.layers = nn.ModuleDict({key: model.layers[key] for key in layer_keys})
        for name in OUTPUT_MODULES if last else ():
            self.add_module(name, getattr(model, name))
        self.loss_normalizer: torch.Tensor | None = None
        """The global loss-token count of the step (set by the trainer before each step)."""
        self.outputs: list[OmniOutput] = []
        """The last stage's per-microbatch outputs of the current step (detached sums for logging)."""

    def forward(self, *hidden: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor:
        h = self._model.embed(batch) if self.is_first else hidden[0]
        h = self._model.run_blocks(h, batch, self.layers.values())
        if not self.is_last:
            return h
        out = self._model.head_loss(h, batch, self.loss_normalizer)
        self.outputs.append(out._replace(loss=out.loss.detach()))
        return out.loss


def _loss_of_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The last stage already returns the microbatch's normalized loss (targets travel in the
    # batch); ``target`` is the placeholder the schedule requires to call a loss function at all.
    return output


Schedule = PipelineScheduleSingle | PipelineScheduleMulti


class Stages:
    """This rank's pipeline stages and the schedule that runs one step of them.

    One schedule per microbatch size, built on first use: its example shapes make the schedule's
    metadata static (no shape-inference round trip, which exchanges pickled objects), and replica
    groups change a rank's rows per step with the number of groups that take part in it.
    """

    def __init__(
        self,
        stages: list[OmniStage],
        stage_indices: list[int],
        config: ParallelConfig,
        *,
        group: torch.distributed.ProcessGroup,
        device: torch.device,
        boundary: tuple[int, int],
        boundary_dtype: torch.dtype,
    ) -> None:
        """``boundary``: (sequence length, width) of the residual stream a stage hands on."""
        self.stages, self.stage_indices, self.config = stages, stage_indices, config
        self.microbatches = config.microbatches
        self.group, self.device = group, device
        self.boundary, self.boundary_dtype = boundary, boundary_dtype
        self._schedules: dict[int, tuple[Schedule, list[PipelineStage]]] = {}

    def schedule_for(self, rows: int) -> Schedule:
        """The schedule for microbatches of ``rows`` rows (built the first time)."""
        return self._built(rows)[0]

    def pipeline_stages(self, rows: int) -> list[PipelineStage]:
        """The ``PipelineStage`` of each of this rank's stages in the schedule for ``rows`` rows
        (what a benchmark instruments: their ``forward_one_chunk`` / ``backward_one_chunk``)."""
        return self._built(rows)[1]

    def _built(self, rows: int) -> tuple[Schedule, list[PipelineStage]]:
        if rows not in self._schedules:
            self._schedules[rows] = self._build_schedule(rows)
        return self._schedules[rows]

    def _build_schedule(self, rows: int) -> tuple[Schedule, list[PipelineStage]]:
        # The residual stream carries gradients back across stages: the examples say so.
        example = torch.empty((rows, *self.boundary), dtype=self.boundary_dtype, device="meta", requires_grad=True)
        loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
        pipeline_stages = [
            PipelineStage(
                stage,
                index,
                self.config.num_stages,
                self.device,
                input_args=() if stage.is_first else (example,),
                output_args=(loss,) if stage.is_last else (example,),
                group=self.group,
            )
            for stage, index in zip(self.stages, self.stage_indices, strict=True)
        ]
        schedule: Schedule
        if self.config.pp_schedule == "1F1B":
            schedule = Schedule1F1B(pipeline_stages[0], self.microbatches, loss_fn=_loss_of_output, scale_grads=False)
        else:
            schedule = ScheduleInterleaved1F1B(
                pipeline_stages, self.microbatches, loss_fn=_loss_of_output, scale_grads=False
            )
        return schedule, pipeline_stages

    def step(self, batch: dict[str, torch.Tensor], loss_normalizer: torch.Tensor) -> list[OmniOutput]:
        """Forward and backward over the microbatches of ``batch``; the last stage's outputs per
        microbatch (empty on the other ranks). Gradients are left in ``.grad``, summed."""
        for stage in self.stages:
            stage.loss_normalizer = loss_normalizer
            stage.outputs = []
        rows = batch["text_tokens"].shape[0]
        if rows % self.microbatches:  # the config check rules this out; the same on every rank if not
            fits = [m for m in range(1, rows + 1) if rows % m == 0]
            raise ConfigError(
                f"this rank's {rows} rows per step do not split into parallel.pp_microbatches="
                f"{self.microbatches}: set parallel.pp_microbatches to one of {fits}"
            )
        schedule = self.schedule_for(rows // self.microbatches)
        unused_targets = torch.zeros(self.microbatches, device=loss_normalizer.device)
        schedule.step(target=unused_targets, return_outputs=False, **batch)
        return [out for stage in self.stages if stage.is_last for out in stage.outputs]
