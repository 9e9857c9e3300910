"""Qwen3 <-> transformers' Qwen3ForCausalLM: parameter names and config.json.

This family's RoPE rotates dim i with dim i + head_dim/2, the layout Qwen's weights are
trained in (titanlite.layers.rope.rotate_halves). So, unlike Llama 3's adapter, no q/k row
permutation is needed, and the per-head_dim QK-norm weights convert as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlite.checkpoint.hf import (DECODER_LAYER, QK_NORM, HFAdapter, decoder_args, decoder_config, decoder_facts,
                                    on_meta, read_decoder_config, rename_from_hf, rename_to_hf)
from titanlite.errors import ConfigError
from titanlite.layers import rope

from .model import ModelArgs, Transformer

_LAYER = DECODER_LAYER | QK_NORM


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full (unsharded) titanlite state dict -> transformers names."""
    return rename_to_hf(state_dict, _LAYER, args.tie_embeddings)


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers state dict -> titanlite names; a tied lm_head.weight is dropped."""
    return rename_from_hf(state_dict, _LAYER, args.tie_embeddings, "Qwen3")


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """ModelArgs -> config.json contents that transformers 4.x and 5.x both read."""
    facts = decoder_facts(on_meta(Transformer, args), "Qwen3ForCausalLM", _LAYER, rope.rotate_halves)
    return decoder_config(args, dtype, "Qwen3ForCausalLM", "qwen3", use_sliding_window=False, **facts)


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """config.json contents -> ModelArgs; ConfigError for what this model cannot express."""
    rope = read_decoder_config(cfg, "qwen3", "Qwen3", ("default",))
    if cfg.get("use_sliding_window"):
        raise ConfigError("config.json sets use_sliding_window; titanlite's Qwen3 attends to the whole context")
    return ModelArgs(**decoder_args(cfg, rope, 40960), ffn_hidden=cfg["intermediate_size"],
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
