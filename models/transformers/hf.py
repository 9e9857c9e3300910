"""A transformers architecture <-> its Hugging Face folder. The model is transformers' own, so
parameter names are the folder's; what differs is only what save_pretrained leaves out (a tied
lm_head, non-persistent buffers older versions saved) and the config, which is the run's whole
transformers config (titanlite.models.transformers.model.ModelArgs.config)."""

from __future__ import annotations

import copy
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
def _model(args: ModelArgs) -> torch.nn.Module:
    """The model `args` describe, on meta (names, shapes and transformers' conversion lookups)."""
    with torch.device("meta"):
        return build(args)


def _names(args: ModelArgs) -> tuple[frozenset[str], dict[str, str]]:
    """The model's state-dict names, and each tied name -> the name it shares its weight with."""
    model = _model(args)
    tied = {k: owner + "." + k.rpartition(".")[2] for k, (owner, _) in model.tied_to.items()}
    return frozenset(model.state_dict()), tied


def _convert(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A folder's `state_dict` through transformers' checkpoint conversion as from_pretrained
    applies it (its conversion_mapping: experts saved one by one fused as the model holds them;
    keys matched, ordered and converted as its convert_and_load_state_dict_in_model does): a key
    it does not convert is kept. On meta tensors too (a folder's headers)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    model = _model(args)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = model.state_dict()
    pending: dict[str, Any] = {}
    out = {}
    for key, tensor in sorted(state_dict.items(), key=lambda kv: dot_natural_key(kv[0])):
        new, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if pattern is None:
            out[new if new in names else key] = tensor
        else:  # one converter per target, fed its sources in the folder's (natural) order
            pending.setdefault(new, copy.deepcopy(by_pattern[pattern])).add_tensor(new, key, pattern, tensor)
    for first, converter in pending.items():
        out |= {k: v[0] if isinstance(v, list) else v
                for k, v in converter.convert(first, model=model, config=model.config).items()}
    return out


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    _, tied = _names(args)
    from transformers.core_model_loading import revert_weight_conversion

    # transformers re-ties on load; the weights as save_pretrained writes them (its reverse
    # conversion: a MoE's experts one by one, as the published folders hold them)
    return revert_weight_conversion(_model(args), {k: v for k, v in state_dict.items() if k not in tied})


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    names, tied = _names(args)
    out = {}
    for key, w in _convert(state_dict, args).items():
        if key.endswith(RECOMPUTED) or key in tied:
            continue
        if key not in names:
            name = causal_lm_class(hf_config(args)).__name__
            raise ConfigError(f"Hugging Face weight '{key}' has no place in {name} as transformers builds it, even "
                              "through transformers' checkpoint conversion: the folder was saved by another "
                              "architecture or transformers version")
        out[key] = w
    out |= {k: out[v] for k, v in tied.items() if v in out}
    return out


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
