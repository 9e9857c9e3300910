"""How gpt-oss is parallelized: the layouts its shapes allow, and its tensor-parallel plan.
titanlite.parallel.apply applies every dimension in one order for every family."""

from __future__ import annotations

from torch.distributed.tensor import Placement

from titanlite.parallel.expert import check_expert_layout
from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TPPlan, decoder_plan

from .model import ModelArgs


def check_layout(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    check_expert_layout(args.moe, dims)


def tp_plan(between: Placement, loss_parallel: bool, model: object = None) -> TPPlan:
    """The shared decoder plan: q, k, v split by heads (their biases with them: colwise), the
    output projection rowwise (its bias added once, after the reduction), the sinks sharded with
    their heads (`TPPlan.head_params`); MoE layers are not split over tp: each tp rank routes its
    own sequence shard over the expert-parallel group."""
    return decoder_plan(between, loss_parallel, moe=True)
