"""Qwen3 <-> transformers' Qwen3ForCausalLM: parameter names and config.json.

This folder's RoPE rotates dim i with dim i + head_dim/2, the layout Qwen's weights are
trained in (see model.apply_rope). So, unlike Llama 3's adapter, no q/k row permutation
is needed, and the per-head_dim QK-norm weights convert as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlite.errors import ConfigError
from titanlite.checkpoint.hf import HFAdapter

from .model import ModelArgs

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full (unsharded) titanlite state dict -> transformers names."""
    out = {}
    for key, w in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue  # transformers re-ties lm_head to the embedding
        if key in _TOP:
            out[_TOP[key]] = w
            continue
        _, layer, rest = key.split(".", 2)
        out[f"model.layers.{layer}.{_LAYER[rest]}"] = w
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers state dict -> titanlite names; a tied lm_head.weight is dropped."""
    out = {}
    for key, w in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older transformers saved; recomputed from the config
        if key in _TOP_BACK:
            if key == "lm_head.weight" and args.tie_embeddings:
                continue
            out[_TOP_BACK[key]] = w
            continue
        parts = key.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in _LAYER_BACK:
            raise ConfigError(f"Hugging Face weight '{key}' has no Qwen3 counterpart in titanlite")
        out[f"layers.{parts[2]}.{_LAYER_BACK[parts[3]]}"] = w
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """ModelArgs -> config.json contents that transformers 4.x and 5.x both read."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "rope_scaling": None, "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "use_sliding_window": False, "torch_dtype": str(dtype).removeprefix("torch.")}


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """config.json contents -> ModelArgs; ConfigError for what this model cannot express."""
    if cfg.get("model_type") != "qwen3":
        raise ConfigError(f"config.json model_type is '{cfg.get('model_type')}', not 'qwen3'")
    if cfg.get("attention_bias"):
        raise ConfigError("config.json sets attention_bias; titanlite's Qwen3 has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act is '{cfg['hidden_act']}'; only silu is supported")
    if cfg.get("use_sliding_window"):
        raise ConfigError("config.json sets use_sliding_window; titanlite's Qwen3 attends to the whole context")
    # transformers 5 nests rope_theta in rope_parameters; 4.x keeps rope_theta and rope_scaling apart
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json rope type '{rope_type}' is not supported (default only)")
    n_heads = cfg["num_attention_heads"]
    return ModelArgs(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
                     ffn_hidden=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                     norm_eps=cfg.get("rms_norm_eps", 1e-6),
                     rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                     max_seq_len=cfg.get("max_position_embeddings", 40960),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
