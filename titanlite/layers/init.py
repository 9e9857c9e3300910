"""Weight initialisation that gives the same weights on every parallel layout.

A parameter's value depends only on (seed, its name in the single-device model, its full
shape): each one is drawn whole from a generator seeded by the seed and the name, then this
rank keeps its shard.
So a sharded parameter holds exactly the slice a single process would draw, and a pipeline
stage or expert shard that holds only some parameters draws the same values as the whole
model. Only one full parameter exists at a time, on the init device.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

def seed_of(seed: int, name: str) -> int:
    """The seed `name`'s values are drawn with: a function of the run's seed and the name alone."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed_of(seed, name))


def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Give `param` (a DTensor shard, or a whole tensor) its part of the whole tensor `full`."""
    if isinstance(param, DTensor):
        # src_data_rank=None slices locally on each rank: no communication
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def normal_(param: torch.Tensor, name: str, seed: int, std: float, cutoff: float | None = None) -> None:
    """N(0, std^2), truncated at +-cutoff*std when cutoff is given, drawn for `name`."""
    device = param.to_local().device if isinstance(param, DTensor) else param.device
    full = torch.empty(param.shape, dtype=torch.float32, device=device)
    gen = _generator(seed, name, device)
    if cutoff is None:
        torch.nn.init.normal_(full, std=std, generator=gen)
    else:
        torch.nn.init.trunc_normal_(full, std=std, a=-cutoff * std, b=cutoff * std, generator=gen)
    copy_full_(param, full.to(param.dtype))


@torch.no_grad()
def uniform_(param: torch.Tensor, name: str, seed: int, low: float, high: float) -> None:
    """U(low, high), drawn for `name`."""
    device = param.to_local().device if isinstance(param, DTensor) else param.device
    full = torch.empty(param.shape, dtype=torch.float32, device=device)
    torch.nn.init.uniform_(full, low, high, generator=_generator(seed, name, device))
    copy_full_(param, full.to(param.dtype))


@torch.no_grad()
def ones_(param: torch.Tensor) -> None:
    param.fill_(1.0)


@torch.no_grad()
def zeros_(param: torch.Tensor) -> None:
    param.zero_()


def to_empty(model: nn.Module, device: torch.device | str) -> None:
    """`model.to_empty(device)` with shared (tied) parameters kept shared: `to_empty` replaces
    plain parameters one by one, which would untie them."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for first, *rest in (names for names in groups.values() if len(names) > 1):
        for name in rest:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(first))


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-built (and parallelized) model on `device`, ties kept (`to_empty`), then
    give it values: `model.init_buffers()` (what construction computes, e.g. RoPE tables), then
    `model.init_weights(seed)`."""
    to_empty(model, device)
    model.init_buffers()
    model.init_weights(seed)
