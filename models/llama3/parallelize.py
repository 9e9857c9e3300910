"""How Llama 3 is parallelized: its tensor-parallel plan (the layouts its shapes
allow are checked for every family by titanlite.preflight and titanlite.parallel.tensor).
titanlite.parallel.apply applies every dimension in one order for every family."""

from __future__ import annotations

from torch.distributed.tensor import Placement

from titanlite.parallel.tensor import TPPlan, decoder_plan


def tp_plan(between: Placement, loss_parallel: bool, model: object = None) -> TPPlan:
    """The decoder's plan: heads and FFN hidden units split over TP; the residual stream is
    `between` outside them."""
    return decoder_plan(between, loss_parallel)
