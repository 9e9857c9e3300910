"""Weight initialisation that gives the same weights on every parallel layout.

Each call draws the *full* tensor from one generator that every rank advances in
the same order, then keeps this rank's shard. A sharded parameter therefore holds
exactly the slice of what a single process would have drawn. Only one full
parameter exists at a time, on the init device.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        # src_data_rank=None slices locally on each rank: no communication
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, generator: torch.Generator, cutoff: float | None = None) -> None:
    """N(0, std^2), truncated at +-cutoff*std when cutoff is given."""
    full = torch.empty(param.shape, dtype=torch.float32, device=generator.device)
    if cutoff is None:
        torch.nn.init.normal_(full, std=std, generator=generator)
    else:
        torch.nn.init.trunc_normal_(full, std=std, a=-cutoff * std, b=cutoff * std, generator=generator)
    _assign(param, full.to(param.dtype))


@torch.no_grad()
def ones_(param: torch.Tensor) -> None:
    param.fill_(1.0)
