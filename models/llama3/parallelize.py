"""How Llama 3 is parallelized: its tensor-parallel plan and the layouts its shapes allow.
titanlite.parallel.apply applies every dimension in one order for every family."""

from __future__ import annotations

from torch.distributed.tensor import Placement

from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TPPlan, check_tp, decoder_plan

from .model import ModelArgs


def check_layout(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    check_tp(dims.tp, args.n_kv_heads, {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
                                        "ffn hidden size": args.ffn_hidden, "vocab_size": args.vocab_size})


def tp_plan(between: Placement, loss_parallel: bool) -> TPPlan:
    """The decoder's plan: heads and FFN hidden units split over TP; the residual stream is
    `between` outside them."""
    return decoder_plan(between, loss_parallel)
