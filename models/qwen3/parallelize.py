"""How Qwen3 is parallelized: Llama 3's tensor-parallel plan and layout checks (the module
names and shape rules match) plus its QK-norms. titanlite.parallel.apply applies every
dimension in one order."""

from __future__ import annotations

from torch.distributed.tensor import Placement
from torch.distributed.tensor.parallel import SequenceParallel

from titanlite.models.llama3.parallelize import check_layout
from titanlite.models.llama3.parallelize import tp_plan as llama_tp_plan
from titanlite.parallel.tensor import TPPlan

__all__ = ["check_layout", "tp_plan"]


def tp_plan(between: Placement, loss_parallel: bool) -> TPPlan:
    """The QK-norm weights (head_dim elements, shared by all heads) are not split: each rank
    normalises its own heads, [B, S, heads, head_dim] sharded on dim 2, with the weight a
    Replicate DTensor, so its gradient comes out Partial and is summed over the ranks' heads."""
    plan = llama_tp_plan(between, loss_parallel)
    norms = {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")}
    return TPPlan(plan.root, plan.block | norms, plan.root_norms, plan.block_norms)
