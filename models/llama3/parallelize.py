"""How Llama 3 is parallelized. Order matters: TP, CP, AC, compile, then FSDP."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from titanlite.config import ConfigError
from titanlite.dist import Meshes, ParallelDims
from titanlite.parallel import ParallelizeOptions, apply_ac, apply_compile, apply_fsdp

from .model import ModelArgs


def validate(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    if dims.tp > args.n_kv_heads:
        # each rank needs at least one whole KV head; replicating KV heads is not implemented
        raise ConfigError(f"parallelism.tensor_parallel_degree {dims.tp} exceeds n_kv_heads {args.n_kv_heads}; "
                          f"use a degree <= {args.n_kv_heads} that divides it")
    for what, size in [("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                       ("ffn hidden size", args.ffn_hidden), ("vocab_size", args.vocab_size),
                       # sequence parallel splits the sequence; max_seq_len is training.seq_len here
                       ("training.seq_len", args.max_seq_len)]:
        if size % dims.tp:
            raise ConfigError(f"{what} {size} is not divisible by parallelism.tensor_parallel_degree "
                              f"{dims.tp}; pick a degree that divides it")


def apply_tp(model: nn.Module, mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style tensor parallel with sequence parallel between the blocks.

    Between blocks the residual stream is a plain tensor holding this rank's sequence
    shard. Attention and feed-forward gather the sequence, work on this rank's heads /
    hidden units, and reduce-scatter back to sequence shards.
    """
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # with loss parallel the logits stay a DTensor sharded on vocab for the loss
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin, ctx): only x is sharded; the RoPE tables are whole on every rank
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None),
                                            use_local_output=True),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    if model.args.tie_embeddings:
        # parallelize_module gave each module its own copy; both shard dim 0 (vocab) on
        # the same mesh, so one DTensor serves the row-wise lookup and the column-wise matmul
        model.output.weight = model.tok_embeddings.weight


def parallelize(model: nn.Module, meshes: Meshes, opts: ParallelizeOptions) -> None:
    if meshes.dims.tp > 1:
        apply_tp(model, meshes.tp, opts.loss_parallel)
    apply_ac(model.layers, opts.activation_checkpoint)
    if opts.compile.enable:
        apply_compile(model.layers)
    if meshes.dims.fsdp:
        apply_fsdp(model, model.layers, meshes.fsdp, opts)
