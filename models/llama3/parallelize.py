"""How Llama 3 is parallelized. Order matters: float8, TP, CP, AC, compile, then FSDP."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from titanlite.config import ConfigError
from titanlite.dist import Meshes, ParallelDims
from titanlite.float8 import apply_float8
from titanlite.parallel import ParallelizeOptions, apply_ac, apply_compile, apply_fsdp, wait_on_output

from .model import ModelArgs


def validate(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    if dims.tp > args.n_kv_heads:
        # each rank needs at least one whole KV head; replicating KV heads is not implemented
        raise ConfigError(f"parallelism.tensor_parallel_degree {dims.tp} exceeds n_kv_heads {args.n_kv_heads}; "
                          f"use a degree <= {args.n_kv_heads} that divides it")
    for what, size in [("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                       ("ffn hidden size", args.ffn_hidden), ("vocab_size", args.vocab_size)]:
        if size % dims.tp:
            raise ConfigError(f"{what} {size} is not divisible by parallelism.tensor_parallel_degree "
                              f"{dims.tp}; pick a degree that divides it")


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Run a module whole on every TP rank, its parameters Replicate DTensors.

    Plain parameters among DTensor ones would break the optimizer's and the gradient
    clipping's foreach ops, so every parameter lives on the TP mesh.
    """
    def params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False)))

    distribute_module(module, mesh, params,
                      input_fn=lambda mod, inputs, mesh: tuple(
                          DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs),
                      output_fn=lambda mod, out, mesh: out.to_local())


def apply_tp(model: nn.Module, mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """Megatron-style tensor parallel, with sequence parallel between the blocks.

    Between blocks the residual stream is a plain tensor: this rank's sequence shard with
    sequence parallel, else the whole sequence. Attention and feed-forward take the whole
    sequence, work on this rank's heads / hidden units, and reduce(-scatter) back.
    """
    between = Shard(1) if sequence_parallel else Replicate()
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
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                           use_local_output=True),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    else:
        blocks = model.layers.values()
        for norm in [model.norm, *(b.attention_norm for b in blocks), *(b.ffn_norm for b in blocks)]:
            _replicate(norm, mesh)
    parallelize_module(model, mesh, root)
    wait_on_output(model.tok_embeddings)  # before compiled blocks
    for layer in model.layers.values():
        parallelize_module(layer, mesh, block)
    if model.args.tie_embeddings:
        # parallelize_module gave each module its own copy; both shard dim 0 (vocab) on
        # the same mesh, so one DTensor serves the row-wise lookup and the column-wise matmul
        model.output.weight = model.tok_embeddings.weight


def parallelize(model: nn.Module, meshes: Meshes, opts: ParallelizeOptions) -> None:
    if opts.float8.enable:
        apply_float8(model.layers, opts.float8, fsdp=meshes.dims.fsdp)
    if meshes.dims.tp > 1:
        apply_tp(model, meshes.tp, opts.loss_parallel, opts.sequence_parallel)
    apply_ac(model.layers, opts.activation_checkpoint)
    if opts.compile.enable:
        apply_compile(model.layers)
    if meshes.dims.fsdp:
        apply_fsdp(model, model.layers, meshes.fsdp, opts)
