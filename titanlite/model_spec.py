"""The seam between the framework and a model family folder under models/."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

import models
from titanlite.config import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """Flavor name -> the family's ModelArgs dataclass."""
    build: Callable[[Any], nn.Module]
    """ModelArgs -> single-device model, built on whatever device is current (meta)."""
    parallelize: Callable[..., None]
    """(model, meshes: titanlite.dist.Meshes, opts: ParallelizeOptions) -> None, in place."""
    flops_per_token: Callable[[Any, int], float]
    """(ModelArgs, seq_len) -> training FLOPs per token (forward + backward)."""
    validate: Callable[[Any, Any], None] = lambda args, dims: None
    """(ModelArgs, ParallelDims) -> raise ConfigError if the layout cannot serve the model."""
    hf: Any = None
    """titanlite.hf_io.HFAdapter mapping weights and config to transformers, if the family has one."""


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg)


def get_model_spec(name: str) -> ModelSpec:
    """Import models.<name> and return its SPEC; copying a folder registers a new family."""
    if name not in available():
        raise ConfigError(f"model.name: unknown model '{name}'; available: {', '.join(available())}")
    return importlib.import_module(f"models.{name}").SPEC


def model_args(spec: ModelSpec, flavor: str, vocab_size: int, seq_len: int) -> Any:
    """The flavor's args with config overrides applied and checked."""
    if flavor not in spec.flavors:
        raise ConfigError(f"model.flavor: unknown flavor '{flavor}' for '{spec.name}'; "
                          f"available: {', '.join(spec.flavors)}")
    args = spec.flavors[flavor]
    if seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len {seq_len} exceeds {spec.name} {flavor}'s "
                          f"max_seq_len {args.max_seq_len}")
    # the RoPE table only needs to cover the training sequence
    updates = {"max_seq_len": seq_len}
    if vocab_size:
        updates["vocab_size"] = vocab_size
    return dataclasses.replace(args, **updates)
