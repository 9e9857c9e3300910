"""A transformers architecture <-> its Hugging Face folder. The model is transformers' own, so
parameter names are the folder's; what differs is only what save_pretrained leaves out (a tied
lm_head, non-persistent buffers older versions saved) and the config, which is the run's whole
transformers config (titanlite.models.transformers.model.ModelArgs.config)."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from titanlite.checkpoint.hf import HFAdapter
from titanlite.errors import ConfigError

from .config import args_from_config, resolve_dict
from .model import ModelArgs, build, causal_lm_class, hf_config

RECOMPUTED = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
"""Buffers some transformers versions saved; the model computes them from the config."""


@cache
def _names(args: ModelArgs) -> tuple[frozenset[str], dict[str, str]]:
    """The model's state-dict names, and each tied name -> the name it shares its weight with."""
    with torch.device("meta"):
        model = build(args)
    tied = {k: owner + "." + k.rpartition(".")[2] for k, (owner, _) in model.tied_to.items()}
    return frozenset(model.state_dict()), tied


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    _, tied = _names(args)
    return {k: v for k, v in state_dict.items() if k not in tied}  # transformers re-ties on load


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    names, tied = _names(args)
    out = {}
    for key, w in state_dict.items():
        if key.endswith(RECOMPUTED) or key in tied:
            continue
        if key not in names:
            name = causal_lm_class(hf_config(args)).__name__
            raise ConfigError(f"Hugging Face weight '{key}' has no place in {name} as transformers builds it: "
                              f"{_why(hf_config(args).model_type)}")
        out[key] = w
    out |= {k: out[v] for k, v in tied.items() if v in out}
    return out


def _why(model_type: str) -> str:
    """Why a folder's weight names are not the model's, as far as transformers says."""
    from transformers import conversion_mapping

    if conversion_mapping.get_checkpoint_conversion_mapping(model_type):
        return (f"transformers converts {model_type}'s saved weights as it loads them (its checkpoint conversion "
                "mapping: experts saved one by one, fused in the model), and titanlite reads the model's own names; "
                "save the loaded model's state_dict() as safetensors next to its config.json")
    return "the folder was saved by another architecture or transformers version"


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    config = hf_config(args).to_dict()
    for key in ("transformers_version", "_name_or_path", "torch_dtype"):
        config.pop(key, None)
    return {**config, "architectures": [causal_lm_class(hf_config(args)).__name__],
            "dtype": str(dtype).removeprefix("torch.")}


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    return args_from_config(resolve_dict(cfg, "config.json"))


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf,
                    training=("output_router_logits", "router_aux_loss_coef"))
