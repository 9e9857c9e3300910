"""How gpt-oss is parallelized: the layouts its shapes allow, and its tensor-parallel plan.
titanlite.parallel.apply applies every dimension in one order for every family."""

from __future__ import annotations

from torch.distributed.tensor import Placement

from titanlite.errors import ConfigError
from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TPPlan, decoder_plan

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


def tp_plan(between: Placement, loss_parallel: bool) -> TPPlan:
    """The shared decoder plan: q, k, v split by heads (their biases with them: colwise), the
    output projection rowwise (its bias added once, after the reduction), the sinks sharded with
    their heads (`TPPlan.head_params`); MoE layers are not split over tp: each tp rank routes its
    own sequence shard over the expert-parallel group."""
    return decoder_plan(between, loss_parallel, moe=True)
