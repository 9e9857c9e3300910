"""titanlite: a small, readable, PyTorch-native LLM pre-training framework.

The public Python API, for scripts around the trainer:

    import titanlite
    titanlite.available_models()                  # ['llama3', 'qwen3', 'qwen3_moe', ...]
    spec = titanlite.get_model_spec("llama3")     # flavors, build, TP plan, HF adapter
    config, hf_state = titanlite.read_hf(folder)  # a transformers folder: config.json, safetensors
    args = spec.hf.args_from_hf(config)
    model = spec.build(args)                      # plain PyTorch, usable at once
    model.load_state_dict(spec.hf.from_hf(hf_state, args))
    titanlite.write_hf(out, spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.bfloat16))

Imports happen on first use, so `import titanlite` stays cheap (the config check runs without torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from titanlite.model_spec import ModelSpec

__all__ = ["available_models", "get_model_spec", "read_hf", "write_hf"]


def available_models() -> list[str]:
    """The model families under models/, by name."""
    from titanlite.model_spec import available

    return available()


def get_model_spec(name: str) -> ModelSpec:
    """The family's ModelSpec (flavors, build, tensor-parallel plan, Hugging Face adapter)."""
    from titanlite.model_spec import get_model_spec as get

    return get(name)


def read_hf(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A transformers folder's config.json and its (sharded) safetensors, in Hugging Face names."""
    from titanlite.checkpoint.hf import read_config, read_safetensors

    return read_config(folder), read_safetensors(folder)


def write_hf(folder: str | Path, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write a folder that transformers' from_pretrained loads: config.json, safetensors shards
    and their index."""
    from titanlite.checkpoint.hf import write_hf_folder

    write_hf_folder(folder, state_dict, config)
