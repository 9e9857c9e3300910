"""How Qwen3 is parallelized: its tensor-parallel plan and the layouts its shapes allow.
titanlite.parallel.apply applies every dimension in one order for every family."""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from titanlite.errors import ConfigError
from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TPPlan

from .model import ModelArgs


def check_layout(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    if dims.tp > args.n_kv_heads:
        # each rank needs at least one whole KV head; replicating KV heads is not implemented
        raise ConfigError(f"parallelism.tensor_parallel_degree {dims.tp} exceeds n_kv_heads {args.n_kv_heads}; "
                          f"use a degree <= {args.n_kv_heads} that divides it")
    for what, size in [("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                       ("ffn_hidden", args.ffn_hidden), ("vocab_size", args.vocab_size)]:
        if size % dims.tp:
            raise ConfigError(f"{what} {size} is not divisible by parallelism.tensor_parallel_degree "
                              f"{dims.tp}; pick a degree that divides it")


def tp_plan(between: Placement, loss_parallel: bool) -> TPPlan:
    """Heads and FFN hidden units split over TP; the residual stream is `between` outside them.

    The QK-norm weights (head_dim elements, shared by all heads) are not split: each rank
    normalises its own heads, [B, S, heads, head_dim] sharded on dim 2, with the weight a
    Replicate DTensor, so its gradient comes out Partial and is summed over the ranks' heads.
    """
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # with loss parallel the logits stay a DTensor sharded on vocab for the loss
        "output": ColwiseParallel(input_layouts=between,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    block = {
        # (x, cos, sin, ctx): only x is distributed; the RoPE tables are whole on every rank
        "attention": PrepareModuleInput(input_layouts=(between, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None),
                                        use_local_output=True),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                           use_local_output=True),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
        "feed_forward.w3": ColwiseParallel(),
    }
    return TPPlan(root, block, root_norms=("norm",), block_norms=("attention_norm", "ffn_norm"))
