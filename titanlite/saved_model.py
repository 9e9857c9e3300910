"""A saved model read back whole in one process (converters, generation): a titanlite checkpoint
folder's family, args and weights, a LoRA run's adapter merged into the base it records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from titanlite.checkpoint.dcp import load_initial
from titanlite.checkpoint.folder import load_tensors, read_info, saved_args, single_process
from titanlite.checkpoint.peft import merge
from titanlite.layers.lora import LoRASetup
from titanlite.errors import ConfigError
from titanlite.layers import init
from titanlite.model_spec import ModelSpec, get_model_spec


def base_weights(spec: ModelSpec, args: Any, base: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a LoRA run trained on, loaded as its trainer loaded them: the run's model (its
    args) seeded, then its checkpoint.initial_load_path through the trainer's own initial load
    and checks (titanlite.checkpoint.dcp.load_initial; titanlite.checkpoint.lora.checkpointing
    records which). A weight a transformers folder lacks keeps the seeded value: the run's seed,
    so one that is not recorded is refused rather than guessed."""
    with torch.device("meta"):
        model = spec.build(args)
    init.materialize(model, torch.device("cpu"), base.get("seed", 0))
    if base["format"] != "seed":
        with single_process():
            fresh = load_initial([model], Path(base["path"]), base["format"], spec, args)
        if fresh and "seed" not in base:
            raise ConfigError(f"{base['path']} holds no weights for {fresh[0]} (and {len(fresh) - 1} more), which the "
                              "LoRA run seeded with a seed its checkpoint does not record; convert its PEFT adapter "
                              "(dcp peft) and merge it onto the base with peft instead")
    return model.state_dict()


def read_dcp(path: Path, merged: bool = True):
    """(spec, args, the model's state dict, the LoRA run's settings or None); a LoRA run's adapter
    `merged` into its base weights, else its trained tensors as saved."""
    info = read_info(path)
    spec = get_model_spec(info["model"])
    args = saved_args(list(spec.flavors.values()), info["args"])
    record = info.get("transform", {})
    if "lora" not in record:
        return spec, args, load_tensors(path, "model."), None
    lora, trained = LoRASetup.of(record["lora"]), load_tensors(path, "model.")
    if not merged:
        return spec, args, trained, lora
    return spec, args, merge(base_weights(spec, args, record["base"]), trained, lora), lora
