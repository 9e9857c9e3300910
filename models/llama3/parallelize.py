"""How Llama 3 is parallelized. Order matters: float8, TP, CP, AC, compile, then FSDP."""

from __future__ import annotations

import torch.nn as nn

from titanlite.config import ConfigError
from titanlite.dist import Meshes, ParallelDims
from titanlite.float8 import apply_float8
from titanlite.parallel import ParallelizeOptions, apply_ac, apply_compile, apply_fsdp

from .model import ModelArgs


def validate(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    for what, size in [("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                       ("ffn hidden size", args.ffn_hidden), ("vocab_size", args.vocab_size)]:
        if size % dims.tp:
            raise ConfigError(f"{what} {size} is not divisible by parallelism.tensor_parallel_degree "
                              f"{dims.tp}; pick a degree that divides it")


def parallelize(model: nn.Module, meshes: Meshes, opts: ParallelizeOptions) -> None:
    if opts.float8.enable:
        apply_float8(model.layers, opts.float8, fsdp=meshes.dims.fsdp)
    apply_ac(model.layers, opts.activation_checkpoint)
    if opts.compile.enable:
        apply_compile(model.layers)
    if meshes.dims.fsdp:
        apply_fsdp(model, model.layers, meshes.fsdp, opts)
