"""How Qwen3-MoE is parallelized. Order: expert parallel, AC, compile of the dense parts, FSDP
(experts on their own mesh first, then blocks, then the root)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from titanlite.config import ConfigError
from titanlite.dist import Meshes, ParallelDims
from titanlite.expert_parallel import apply_ep, set_stats_group, shard_experts
from titanlite.parallel import ParallelizeOptions, apply_ac, apply_fsdp

from .model import ModelArgs


def validate(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    if dims.tp > 1:
        raise ConfigError("parallelism.tensor_parallel_degree > 1 is not supported for qwen3_moe yet; use 1")
    if args.moe.num_experts % dims.ep:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep} does not divide the model's "
                          f"{args.moe.num_experts} experts; pick a degree that divides it")


def parallelize(model: nn.Module, meshes: Meshes, opts: ParallelizeOptions) -> None:
    dims = meshes.dims
    if dims.ep > 1:
        apply_ep(model, meshes.experts["ep"])
    if dims.dp * dims.cp > 1:
        set_stats_group(model, meshes.dp_cp.get_group())
    apply_ac(model.layers, opts.activation_checkpoint)
    if opts.compile.enable:
        # routing has data-dependent shapes: compile attention, whose shapes are static
        for block in model.layers.values():
            block.attention.compile(fullgraph=True)
    if dims.fsdp:
        if dims.ep > 1:
            mesh = meshes.experts["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else meshes.experts["efsdp"]
            mp = MixedPrecisionPolicy(param_dtype=opts.param_dtype, reduce_dtype=opts.reduce_dtype)
            shard_experts(model, mesh, mp, opts.reshard_after_forward != "never")
        apply_fsdp(model, model.layers, meshes.fsdp, opts)
