"""Hugging Face interop: Qwen3ForCausalLM state dicts and configs <-> this folder's model.

RoPE is implemented in the rotate-half layout that Qwen's weights are trained with
(see model.apply_rope), so q/k projections and the per-head q/k norms convert by
name alone: no row permutation is needed in either direction.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .model import ModelArgs

# ours <-> Hugging Face, with {} for the layer index
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_TO_OURS_LAYER = {v: k for k, v in _LAYER_KEYS.items()}
_HF_TO_OURS_TOP = {v: k for k, v in _TOP_KEYS.items()}


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full (unsharded) state dict -> Qwen3ForCausalLM names. A tied output is left
    out, as Hugging Face saves it."""
    out = {}
    for key, value in state_dict.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        m = _OURS_LAYER.fullmatch(key)
        if m and m.group(2) in _LAYER_KEYS:
            out[f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"] = value
        elif key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = value
        else:
            raise KeyError(f"qwen3 hf export: no Hugging Face name for '{key}'")
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Qwen3ForCausalLM names -> ours. With tied embeddings the output is the embedding
    table; a stored lm_head.weight is then ignored."""
    out = {}
    for key, value in hf_state_dict.items():
        m = _HF_LAYER.fullmatch(key)
        if m and m.group(2) in _HF_TO_OURS_LAYER:
            out[f"layers.{m.group(1)}.{_HF_TO_OURS_LAYER[m.group(2)]}"] = value
        elif key in _HF_TO_OURS_TOP:
            if not (args.tie_embeddings and key == "lm_head.weight"):
                out[_HF_TO_OURS_TOP[key]] = value
        elif not key.endswith("rotary_emb.inv_freq"):
            raise KeyError(f"qwen3 hf import: unexpected Hugging Face key '{key}'")
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def args_from_hf_config(cfg: Any) -> ModelArgs:
    """A transformers Qwen3Config (or its config.json as a dict) -> ModelArgs."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    # transformers 5 keeps theta in rope_parameters; older config.json files have rope_theta
    # at the top level and rope_scaling (null for the released Qwen3 models)
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"qwen3 hf import: only the default RoPE is supported, got {rope}")
    theta = rope.get("rope_theta") or get("rope_theta")
    return ModelArgs(dim=get("hidden_size"), n_layers=get("num_hidden_layers"), n_heads=get("num_attention_heads"),
                     n_kv_heads=get("num_key_value_heads"), head_dim=get("head_dim"),
                     ffn_hidden=get("intermediate_size"), vocab_size=get("vocab_size"), norm_eps=get("rms_norm_eps"),
                     rope_theta=float(theta), max_seq_len=get("max_position_embeddings"),
                     tie_embeddings=bool(get("tie_word_embeddings")))


def hf_config(args: ModelArgs) -> Any:
    """ModelArgs -> a transformers Qwen3Config describing the same network."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden,
                       num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                       num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
                       max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.tie_embeddings,
                       rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
