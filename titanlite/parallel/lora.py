"""LoRA under tensor parallel: the plan shards each adapter as its layer (titanlite.layers.lora
adapts the layers and freezes the rest before the plan, the second step of the one parallelize
order, after float8):

- a column-parallel layer (weight Shard(0), output split on features): A replicated, B
  Shard(0). x A^T is computed whole on every rank (a few columns: the rank), B splits the
  output as W does; A's gradient comes out Partial and is summed over tp, as a replicated weight's.
- a row-parallel layer (weight Shard(1), input split on features): A Shard(1), B replicated.
  Each rank's x_i A_i^T is a Partial sum, B keeps it Partial, and it joins W x's Partial output
  in the layer's one reduce(-scatter): no collective of its own.

Both are Megatron's (and PEFT's) tensor-parallel LoRA, and exact: each rank computes its shard
of the single-device result. Layers run whole on every rank (a MoE router, a shared expert)
keep their adapters whole too.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titanlite.layers.lora import LoRALinear
from titanlite.parallel.tensor import TPPlan


class AdaptedStyle(ParallelStyle):
    """A linear layer's tensor-parallel style (torch's ColwiseParallel or RowwiseParallel), with
    its adapter sharded to match (the module doc). A layer without an adapter gets the style alone."""

    def __init__(self, base: ParallelStyle) -> None:
        super().__init__()
        self.base = base
        self.src_data_rank = base.src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoRALinear):
            return self.base._apply(module, device_mesh)
        a, b = module.lora_A, module.lora_B
        del module.lora_A, module.lora_B  # the style would shard every parameter under it as the weight
        self.base._apply(module, device_mesh)
        module.lora_A, module.lora_B = a, b
        (split,) = module.weight.placements
        placements = {Shard(0): (Replicate(), Shard(0)), Shard(1): (Shard(1), Replicate())}.get(
            split, (Replicate(), Replicate()))
        for linear, placement in zip((a, b), placements):
            w = linear.weight
            linear.weight = nn.Parameter(distribute_tensor(w, device_mesh, [placement], src_data_rank=None),
                                         requires_grad=w.requires_grad)
        return module


def with_adapters(plan: TPPlan) -> TPPlan:
    """The family's tensor-parallel plan with each linear layer's style sharding its adapter too."""
    def wrap(styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
        return {n: AdaptedStyle(s) if isinstance(s, (ColwiseParallel, RowwiseParallel)) else s
                for n, s in styles.items()}

    return dataclasses.replace(plan, root=wrap(plan.root), block=wrap(plan.block))
