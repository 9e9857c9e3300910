"""How Qwen3-MoE is parallelized: the layouts its shapes allow, and its tensor-parallel plan.
titanlite.parallel.apply applies every dimension (expert parallel included) in one order for
every family; MoE layers need nothing from the family beyond these checks and their TP entries."""

from __future__ import annotations

from dataclasses import replace

from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from titanlite.errors import ConfigError
from titanlite.models.qwen3.parallelize import tp_plan as _qwen3_tp_plan
from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TokenParallel, TPPlan

from .model import ModelArgs


def check_layout(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    if dims.tp > 1 and dims.ep % dims.tp:
        # each tp rank routes its own tokens; experts are split over ep groups of whole tp groups
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep}: MoE blocks under tensor_parallel_degree "
                          f"{dims.tp} need an expert-parallel degree that is a multiple of it; use {dims.tp}")
    if args.moe.num_experts % dims.ep:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep} does not divide the model's "
                          f"{args.moe.num_experts} experts; pick a degree that divides it")
    if not 1 <= args.moe.top_k <= args.moe.num_experts:
        raise ConfigError(f"the model's top_k {args.moe.top_k} must be between 1 and its "
                          f"{args.moe.num_experts} experts")


def tp_plan(between: Placement, loss_parallel: bool) -> TPPlan:
    """Attention and dense feed-forwards as in Qwen3. A MoE layer is not split over tp: each
    tp rank routes its own sequence shard (the layer's input and output stay Shard(1); without
    sequence parallel the layer takes its shard of the whole sequence and gathers the result),
    dispatching it over the expert-parallel group, which spans whole tp groups. The router (and
    a shared expert) run whole on each rank's tokens, their gradients summed over tp."""
    plan = _qwen3_tp_plan(between, loss_parallel)
    moe = {
        "moe": PrepareModuleInputOutput(input_layouts=(between,), desired_input_layouts=(Shard(1),),
                                        use_local_input=True, output_layouts=(Shard(1),),
                                        desired_output_layouts=(between,), use_local_output=True),
        "moe.router.gate": TokenParallel(),
        "moe.shared": TokenParallel(),
    }
    return replace(plan, block=plan.block | moe)
