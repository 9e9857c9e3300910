"""titanlite: a small, readable, PyTorch-native LLM pre-training framework.

The public Python API, for scripts around the trainer:

    import titanlite
    titanlite.available_models()                  # ['llama3', 'qwen3', 'qwen3_moe', ...]
    spec = titanlite.get_model_spec("llama3")     # flavors, build, TP plan, HF adapter
    model, args = titanlite.load_hf(folder, "llama3")  # a transformers folder as plain PyTorch
    titanlite.write_hf(out, spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.bfloat16))

`load_hf` is `read_hf` (config.json, safetensors), `spec.hf.args_from_hf`, `spec.build`, and
`spec.hf.from_hf` into the model, with the one thing a plain `load_state_dict` gets wrong: the
weights transformers does not save (DeepSeek-V3's multi-token prediction) keep their seeded
values, and a line says so. `config_to_hf` refuses a model its architecture cannot compute.

Imports happen on first use, so `import titanlite` stays cheap (the config check runs without torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from titanlite.model_spec import ModelSpec

__all__ = ["available_models", "get_model_spec", "load_hf", "read_hf", "write_hf"]


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


def load_hf(folder: str | Path, name: str, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A transformers folder as model family `name`'s model (on the current device) and its
    ModelArgs. Every weight the folder holds is loaded (shapes checked); those it lacks as a whole
    group the adapter declares optional (HFAdapter.optional) start from their initial values for
    `seed`, said in one line on stderr; any other missing weight is an error."""
    import sys

    from titanlite.checkpoint.weights import check_shapes
    from titanlite.checkpoint.hf import check_hf_config, fresh_line, fresh_names, read_config, read_safetensors
    from titanlite.errors import ConfigError

    spec = get_model_spec(name)
    if spec.hf is None:
        raise ConfigError(f"model '{name}' has no Hugging Face adapter (models/{name}/hf.py)")
    args = spec.hf.args_from_hf(read_config(folder))
    check_hf_config(spec.hf, folder, args)  # what the family builds computes what the folder says (its activation)
    model = spec.build(args)
    model.init_weights(seed)
    state = spec.hf.from_hf(read_safetensors(folder), args)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    fresh = fresh_names(spec.hf, expected, state)
    check_shapes({k: v for k, v in expected.items() if k not in fresh}, {k: v.shape for k, v in state.items()},
                 str(folder))
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise ConfigError(f"{folder}: '{unexpected[0]}' has no place in {name}'s model")
    if fresh:
        print(fresh_line(fresh, folder), file=sys.stderr, flush=True)
    return model, args


def write_hf(folder: str | Path, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write a folder that transformers' from_pretrained loads: config.json, safetensors shards
    and their index."""
    from titanlite.checkpoint.hf import write_hf_folder

    write_hf_folder(folder, state_dict, config)
