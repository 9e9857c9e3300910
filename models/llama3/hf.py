"""Llama 3 <-> transformers' LlamaForCausalLM: parameter names, the RoPE row order, config.json.

titanlite rotates adjacent pairs (Meta's layout, dims 2i and 2i+1); transformers rotates
dim i with dim i + head_dim/2. Both compute the same attention if the rows of wq and wk
are permuted within each head, which `_regroup_qk` does.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlite.checkpoint.hf import (DECODER_LAYER, HFAdapter, decoder_args, decoder_config, decoder_facts, on_meta,
                                    read_decoder_config, rename_from_hf, rename_to_hf)
from titanlite.errors import ConfigError
from titanlite.layers import rope

from .model import ModelArgs, Transformer


def _regroup_qk(state_dict: dict[str, torch.Tensor], args: ModelArgs, to_halves: bool) -> dict[str, torch.Tensor]:
    """Reorder, in place, the rows within each head of wq and wk (q_proj and k_proj) from pairs
    (2i, 2i+1) to halves (i, i + head_dim/2), or back: the head's rows viewed as
    [head_dim/2, 2] or [2, head_dim/2], transposed."""
    heads = {"wq": args.n_heads, "q_proj": args.n_heads, "wk": args.n_kv_heads, "k_proj": args.n_kv_heads}
    for key, w in state_dict.items():
        if n_heads := heads.get(key.split(".")[-2]):
            rows, cols = w.shape
            pairs = (rows // n_heads // 2, 2) if to_halves else (2, rows // n_heads // 2)
            state_dict[key] = w.view(n_heads, *pairs, cols).transpose(1, 2).reshape(rows, cols)
    return state_dict


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return _regroup_qk(rename_to_hf(state_dict, DECODER_LAYER, args.tie_embeddings), args, to_halves=True)


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return _regroup_qk(rename_from_hf(state_dict, DECODER_LAYER, args.tie_embeddings, "Llama 3"), args, to_halves=False)


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    if args.sliding_window or args.attn_sinks:
        raise ConfigError("LlamaForCausalLM has no sliding windows or attention sinks: this flavor has no "
                          "Hugging Face form; export a flavor without them")
    rope_scaling = None
    if args.rope_scaling_factor:
        rope_scaling = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                        "low_freq_factor": args.rope_low_freq_factor,
                        "high_freq_factor": args.rope_high_freq_factor,
                        "original_max_position_embeddings": args.rope_original_max_seq_len}
    facts = decoder_facts(on_meta(Transformer, args), "LlamaForCausalLM", DECODER_LAYER, rope.rotate_pairs)
    return decoder_config(args, dtype, "LlamaForCausalLM", "llama", rope_scaling, mlp_bias=False, **facts)


def _ffn_args(dim: int, hidden: int) -> dict[str, Any]:
    """multiple_of / ffn_dim_multiplier that make ModelArgs.ffn_hidden equal `hidden`."""
    base = int(2 * 4 * dim / 3)
    if base <= hidden:
        return {"multiple_of": hidden, "ffn_dim_multiplier": None}  # rounds base up to exactly hidden
    return {"multiple_of": 1, "ffn_dim_multiplier": (hidden + 0.5) / base}


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    rope = read_decoder_config(cfg, "llama", "Llama 3", ("default", "llama3"), biases=("attention_bias", "mlp_bias"))
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise ConfigError(f"config.json head_dim {cfg['head_dim']} differs from hidden_size / "
                          f"num_attention_heads = {dim // n_heads}, which titanlite assumes")
    scaling = {}
    if rope["rope_type"] == "llama3":
        scaling = dict(rope_scaling_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    args = ModelArgs(**decoder_args(cfg, rope, 2048), **_ffn_args(dim, cfg["intermediate_size"]), **scaling)
    if args.ffn_hidden != cfg["intermediate_size"]:
        raise ConfigError(f"config.json intermediate_size {cfg['intermediate_size']} cannot be expressed "
                          f"by titanlite's Llama 3 (got {args.ffn_hidden})")
    return args


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
