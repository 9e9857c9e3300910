"""How Qwen3-MoE is parallelized: the layouts its shapes allow, and its tensor-parallel plan.
titanlite.parallel.apply applies every dimension (expert parallel included) in one order for
every family; MoE layers need nothing from the family beyond these checks and their TP entries."""

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
    """Qwen3's plan (QK-norm included) for attention and dense feed-forwards; MoE layers are not
    split over tp: each tp rank routes its own sequence shard over the expert-parallel group
    (see titanlite.parallel.tensor.decoder_plan)."""
    return decoder_plan(between, loss_parallel, qk_norm=True, moe=True)
