"""Full tensors into a model's parameters, which may be sharded DTensors: the shape check every
load starts with, and a model's initial weights from a transformers folder, a block at a time."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.checkpoint.hf import HFAdapter, block_groups, fresh_names, read_safetensors
from titanlite.errors import ConfigError


def check_shapes(expected: dict[str, torch.Size], found: dict[str, torch.Size], where: str) -> None:
    """First missing key or shape mismatch, as one clear error."""
    for key, shape in expected.items():
        if key not in found:
            raise ConfigError(f"{where} has no '{key}' (the model expects shape {tuple(shape)})")
        if tuple(found[key]) != tuple(shape):
            raise ConfigError(f"{where}: '{key}' has shape {tuple(found[key])} but the model's is {tuple(shape)}; "
                              "the checkpoint was made for a different model config")


def assign_full(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into those of a model's parameters they name, which may be sharded DTensors."""
    with torch.no_grad():
        for key, param in model.state_dict().items():
            if key not in full:
                continue  # loaded with another group of tensors
            src = full[key].to(param.dtype)
            if isinstance(param, DTensor):
                # every rank holds the full tensor, so each keeps its slice without communication
                src = distribute_tensor(src, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param = param.to_local()
            param.copy_(src)


def load_hf_weights(parts: list[nn.Module], path: Path, adapter: HFAdapter, args: Any,
                    whole: Collection[str] | None = None) -> list[str]:
    """A transformers folder into the parts (sharded or not), one decoder block at a time: a
    rank holds its own shards and one block's full tensors, never the whole model, and reads no
    block its parts lack (pipeline stages). Shapes are checked first, from the files' headers.
    `whole`: the whole model's names (default: the parts'); a part's parameter outside it (a
    LoRA adapter) is not the folder's to give. Returns the names of `whole` that the folder lacks
    and that keep their initial values (HFAdapter.optional), for the caller to say once."""
    headers = read_safetensors(path, meta=True)
    states = [part.state_dict() for part in parts]
    found = {k: v.shape for k, v in adapter.from_hf(headers, args).items()}
    fresh = fresh_names(adapter, whole if whole is not None else [k for sd in states for k in sd], found)
    check_shapes({k: v.shape for sd in states for k, v in sd.items()
                  if k not in fresh and (whole is None or k in whole)}, found, str(path))
    mine = {k for sd in states for k in sd}
    unread = adapter.from_hf({}, args)  # what needs no weight (a MoE's zero router bias)
    for part in parts:
        assign_full(part, unread)
    for names in block_groups(headers):
        if not (adapter.from_hf({k: headers[k] for k in names}, args).keys() - unread.keys()) & mine:
            continue
        full = adapter.from_hf(read_safetensors(path, set(names)), args)
        for part in parts:
            assign_full(part, {k: v for k, v in full.items() if k not in unread})
    return fresh
