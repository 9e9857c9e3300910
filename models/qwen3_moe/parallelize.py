"""How Qwen3-MoE is parallelized: the layouts its shapes allow, and its tensor-parallel plan.
titanlite.parallel.apply applies every dimension (expert parallel included) in one order for
every family; MoE layers need nothing from the family beyond these checks."""

from __future__ import annotations

from torch.distributed.tensor import Placement

from titanlite.errors import ConfigError
from titanlite.models.qwen3.parallelize import tp_plan as _qwen3_tp_plan
from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TPPlan

from .model import ModelArgs


def check_layout(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    if dims.tp > 1:
        raise ConfigError(f"parallelism.tensor_parallel_degree {dims.tp}: MoE blocks under tensor parallelism "
                          "are not implemented yet; use 1 (expert and data parallelism shard the experts)")
    if args.moe.num_experts % dims.ep:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep} does not divide the model's "
                          f"{args.moe.num_experts} experts; pick a degree that divides it")
    if not 1 <= args.moe.top_k <= args.moe.num_experts:
        raise ConfigError(f"the model's top_k {args.moe.top_k} must be between 1 and its "
                          f"{args.moe.num_experts} experts")


def tp_plan(between: Placement, loss_parallel: bool) -> TPPlan:
    """Attention as in Qwen3 (check_layout refuses tp > 1 until MoE blocks have a plan)."""
    return _qwen3_tp_plan(between, loss_parallel)
