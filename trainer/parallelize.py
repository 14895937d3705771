"""Hybrid parallelism for the omni model: tensor parallel inside a node, FSDP2 across data-parallel ranks.

Order as in torchtitan: tensor parallelism first (it turns parameters into DTensors on the ``tp`` mesh),
then activation checkpointing, then FSDP2 (``fully_shard``), which shards those DTensors further on the
``dp_shard`` mesh. Both go through parameters by module name only; the names this file relies on are
listed in the docstring of :mod:`resilient.trainer.model.omni` ("Parallelization surface").

Resulting parameter placements on the ("dp_shard", "tp") mesh:

- attention/MLP matrices: sharded on tp (rows of wq/wk/wv/w1/w3, columns of wo/w2) and on dp_shard;
  when both shard dim 0 the dp placement is ``_StridedShard`` (never derive offsets from rank math);
- text embedding (vocabulary rows) and text head (vocabulary columns): sharded on tp and dp_shard;
- every other parameter (norms, modality embedding, audio/video projections and heads):
  ``(Shard(0), Replicate())``, so every parameter is a DTensor on the full mesh and a checkpoint can
  see from placements alone which ranks hold the same bytes.
With ``tp == 1`` no tensor parallelism is applied and parameters are 1-D DTensors on ``dp_shard``.

Gradients are SUMMED (not averaged) over dp_shard: the model divides its summed loss by a
normalizer the trainer passes in (the global token count), which makes the sum the gradient of the
global mean loss even when ranks hold different numbers of tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from resilient.errors import ConfigError
from resilient.trainer.parallel_config import (  # noqa: F401  (re-exported: the public names of parallelize)
    ACTIVATION_CHECKPOINTING,
    FULL_MESH_DIM_NAMES,
    MESH_DIM_NAMES,
    MIXED_PRECISION,
    ParallelConfig,
    check_model_compatible,
)

# Per-block tensor-parallel plan (Megatron-LM, Shoeybi et al. 2019): column-parallel into the heads /
# hidden units, row-parallel out of them, so each block needs one all-reduce after attention and one
# after the MLP, and each rank holds n_heads / tp whole heads.
_BLOCK_PLAN: dict[str, ParallelStyle] = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}

# The same plan with sequence parallelism (Korthikanti et al. 2022, as in torchtitan): between the
# tensor-parallel regions the residual stream and the norms hold 1/tp of the sequence. Entering
# attention or the MLP all-gathers the sequence (instead of nothing); leaving, the row-parallel output
# is reduce-scattered along it (instead of all-reduced): the same bytes on the wire, and the norms'
# activations and the residual stream take 1/tp of the memory.
_SEQUENCE_PARALLEL_BLOCK_PLAN: dict[str, ParallelStyle] = {
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(
        input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
    ),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
}


def build_mesh(dp_shard: int, tp: int, device_type: str = "cpu", *, pp: int = 1) -> DeviceMesh:
    """The group's DeviceMesh over the default process group: ("dp_shard", "tp"), or with pp > 1
    ("pp", "dp_shard", "tp"); tp is the inner dim, pp the outer.

    tp innermost: consecutive ranks (one node's GPUs under torchrun) share the tp groups, whose
    per-block all-reduces are the most latency-bound traffic; pp outermost, as in torchtitan: its
    point-to-point activations are the least latency-bound and may cross nodes.
    """
    if not dist.is_initialized():
        raise ConfigError("build_mesh needs an initialized default process group (dist.init_process_group)")
    world = dist.get_world_size()
    if pp * dp_shard * tp != world:
        raise ConfigError(
            f"pp={pp} × dp_shard={dp_shard} × tp={tp} = {pp * dp_shard * tp} must equal the world size {world}"
        )
    if pp == 1:
        return init_device_mesh(device_type, (dp_shard, tp), mesh_dim_names=MESH_DIM_NAMES)
    return init_device_mesh(device_type, (pp, dp_shard, tp), mesh_dim_names=FULL_MESH_DIM_NAMES)


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ("dp_shard", "tp") mesh a stage's parameters live on (the mesh itself without pp)."""
    return mesh if mesh.ndim == 2 else mesh[MESH_DIM_NAMES]


def parallelize_model(model: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> nn.Module:
    """Apply TP, activation checkpointing and FSDP2 to ``model`` in place; returns it.

    ``model``: an ``OmniModel`` or one pipeline stage of it (``resilient.trainer.pipeline_parallel.OmniStage``,
    which holds the embeddings or heads only on the first or last stage). Call on the fully
    initialized, unsharded model, built identically (same seed) on every rank:
    shards are cut locally (the tensor-parallel replicated modules are broadcast from tp rank 0:
    a collective, so every rank of the mesh builds together). Afterwards call the model only through
    ``forward`` (FSDP2 gathers parameters in hooks around it), build the optimizer over
    ``model.parameters()``, and normalize the loss globally (see the module docstring).
    """
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES:
        raise ConfigError(f"mesh dims are {mesh.mesh_dim_names}, parallelize_model needs {MESH_DIM_NAMES}")
    if tuple(mesh.shape) != (config.dp_shard, config.tp):
        raise ConfigError(
            f"mesh shape {tuple(mesh.shape)} does not match ParallelConfig (dp_shard={config.dp_shard}, tp={config.tp})"
        )
    check_model_compatible(config, model.config)
    if config.tp > 1:
        _apply_tensor_parallel(model, mesh["tp"], sequence_parallel=config.sequence_parallel)
    if config.activation_checkpointing == "full":
        for block in model.layers.values():
            # The composable API keeps parameter FQNs unchanged (checkpoint_wrapper would insert
            # "_checkpoint_wrapped_module." into every name the checkpoint stores).
            checkpoint(block, preserve_rng_state=False)
    if config.tp > 1 and config.sequence_parallel:
        # After checkpointing, so that checkpoint's pre-hook on the first block runs before the cut's:
        # it saves the block's inputs before the sequence is cut, and its recompute (which calls the
        # block again, cutting hook included) then cuts the same whole input once, not a cut one twice.
        _cut_sequence_before_first_block(model, mesh["tp"])
    _apply_fsdp(model, mesh["dp_shard"], config)
    return model


def _apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    # src_data_rank=None: each rank cuts its shard from its own full copy (identical by the seeded
    # init), as fully_shard does, instead of broadcasting every weight from tp rank 0.
    plan = _SEQUENCE_PARALLEL_BLOCK_PLAN if sequence_parallel else _BLOCK_PLAN
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan, src_data_rank=None)
    if sequence_parallel:
        _gather_sequence_after_final_norm(model, tp_mesh)
    root_plan: dict[str, ParallelStyle] = {
        # Vocabulary-sharded lookup, summed across tp (a row lives on one rank; the others add 0).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # Vocabulary-sharded logits, gathered so the loss runs unchanged on every tp rank.
        "text_head": ColwiseParallel(output_layouts=Replicate()),
    }
    # A pipeline stage holds the embedding (first stage) or the head (last stage), or neither.
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name, None) is not None}
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan, src_data_rank=None)
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and not all(isinstance(p, DTensor) for p in own):
            if any(isinstance(p, DTensor) for p in own):
                raise ConfigError(f"module {name!r} mixes tensor-parallel and plain parameters")
            parallelize_module(module, tp_mesh, _ReplicateOnTP(), src_data_rank=None)


def _cut_sequence_before_first_block(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Cut the (replicated) embeddings' output along the sequence as it enters the first block. A
    pipeline stage without the first block receives the sequence-sharded stream as it is."""
    if "0" in model.layers:
        scatter = PrepareModuleInput(
            input_layouts=(Replicate(), None, None, None),
            desired_input_layouts=(Shard(1), None, None, None),
            use_local_output=True,  # the residual stream stays a plain tensor, as it is between blocks
        )
        parallelize_module(model.layers["0"], tp_mesh, scatter)


def _gather_sequence_after_final_norm(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The final norm runs on the sequence slice, its output gathered back whole for the heads
    (they select positions by boolean masks over the whole row). A stage without it hands on the
    sequence-sharded stream as it is."""
    if getattr(model, "norm", None) is not None:
        parallelize_module(model.norm, tp_mesh, SequenceParallel(), src_data_rank=None)
        gather = PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
        parallelize_module(model.norm, tp_mesh, gather)


class _ReplicateOnTP(ParallelStyle):
    """Compute a small module redundantly on every tp rank, its parameters Replicate() DTensors.

    Like torchtitan's ``NoParallel``. Inputs arrive as plain tensors holding the same values on every
    tp rank (the outputs of row-parallel layers are all-reduced); wrapping them as Replicate costs no
    communication, and their gradients come out identical on every tp rank too.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, self._wrap_inputs, self._unwrap_output)

    @staticmethod
    def _wrap_inputs(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    @staticmethod
    def _unwrap_output(module: nn.Module, output: object, device_mesh: DeviceMesh) -> object:
        return output.to_local() if isinstance(output, DTensor) else output


def _apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, config: ParallelConfig) -> None:
    if config.mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    # Under pipelining a block runs once per microbatch: keep its parameters gathered from its
    # first forward to its backward (torchtitan's default) instead of all-gathering them again.
    reshard = config.pp == 1
    # One FSDP unit per block (its all-gather overlaps the previous block's compute), and the root
    # unit for embeddings, projections, final norm and heads.
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean, over dp_shard (see the module docstring). Forcing plain SUM also avoids
            # AVG/PREMUL_SUM, which gloo does not implement.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
