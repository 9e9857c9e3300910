"""A saved model read back whole in one process (converters, generation): a titanlite checkpoint
folder's family, args and weights, a LoRA run's adapter merged into the base it records."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

import titanlite
from titanlite.checkpoint.dcp import load_tensors, read_info
from titanlite.checkpoint.peft import merge
from titanlite.layers.lora import LoRASetup
from titanlite.model_spec import ModelSpec, get_model_spec


def rebuild_args(templates: list[Any], values: dict[str, Any]) -> Any:
    """ModelArgs from their saved JSON form: nested dataclasses (a MoE layer's args, YaRN) and
    tuples come back as dicts and lists. `templates`: the family's flavors; a nested field takes
    its type from the first that sets it (a flavor may leave it None, as DeepSeek-V3 16B's YaRN)."""
    fields = {}
    for f in dataclasses.fields(templates[0]):
        if f.name not in values:
            continue
        v, kinds = values[f.name], [getattr(t, f.name) for t in templates]
        nested = [k for k in kinds if dataclasses.is_dataclass(k)]
        if v is None or not (nested or isinstance(kinds[0], tuple)):
            fields[f.name] = v
        else:
            fields[f.name] = rebuild_args(nested, v) if nested else tuple(v)
    return dataclasses.replace(templates[0], **fields)


def base_weights(spec: ModelSpec, args: Any, base: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a LoRA run trained on, as it read them (titanlite.checkpoint.lora.checkpointing)."""
    if base["format"] == "hf":
        return titanlite.load_hf(base["path"], spec.name)[0].state_dict()
    if base["format"] == "dcp":
        return load_tensors(base["path"], "model.")
    model = spec.build(args)
    model.init_weights(base["seed"])
    return model.state_dict()


def read_dcp(path: Path, merged: bool = True):
    """(spec, args, the model's state dict, the LoRA run's settings or None); a LoRA run's adapter
    `merged` into its base weights, else its trained tensors as saved."""
    info = read_info(path)
    spec = get_model_spec(info["model"])
    args = rebuild_args(list(spec.flavors.values()), info["args"])
    record = info.get("transform", {})
    if "lora" not in record:
        return spec, args, load_tensors(path, "model."), None
    lora, trained = LoRASetup.of(record["lora"]), load_tensors(path, "model.")
    if not merged:
        return spec, args, trained, lora
    return spec, args, merge(base_weights(spec, args, record["base"]), trained, lora), lora
