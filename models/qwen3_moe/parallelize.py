"""How Qwen3-MoE is parallelized: activation checkpointing, compile of the dense parts, FSDP."""

from __future__ import annotations

import torch.nn as nn

from titanlite.config import ConfigError
from titanlite.dist import Meshes, ParallelDims
from titanlite.parallel import ParallelizeOptions, apply_ac, apply_fsdp

from .model import ModelArgs


def validate(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    if dims.tp > 1:
        raise ConfigError("parallelism.tensor_parallel_degree > 1 is not supported for qwen3_moe yet; use 1")


def parallelize(model: nn.Module, meshes: Meshes, opts: ParallelizeOptions) -> None:
    apply_ac(model.layers, opts.activation_checkpoint)
    if opts.compile.enable:
        # routing has data-dependent shapes: compile attention, whose shapes are static
        for block in model.layers.values():
            block.attention.compile(fullgraph=True)
    if meshes.dims.fsdp:
        apply_fsdp(model, model.layers, meshes.fsdp, opts)
