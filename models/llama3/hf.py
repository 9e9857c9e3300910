"""Llama 3 <-> transformers' LlamaForCausalLM: parameter names, the RoPE row order, config.json.

titanlite rotates adjacent pairs (Meta's layout, dims 2i and 2i+1); transformers rotates
dim i with dim i + head_dim/2. Both compute the same attention if the rows of wq and wk
are permuted within each head, which `_to_halves` / `_to_pairs` do.
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
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def _to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out = {}
    for key, w in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue  # transformers re-ties lm_head to the embedding
        if key in _TOP:
            out[_TOP[key]] = w
            continue
        _, layer, rest = key.split(".", 2)
        if rest == "attention.wq.weight":
            w = _to_halves(w, args.n_heads)
        elif rest == "attention.wk.weight":
            w = _to_halves(w, args.n_kv_heads)
        out[f"model.layers.{layer}.{_LAYER[rest]}"] = w
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
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
            raise ConfigError(f"Hugging Face weight '{key}' has no Llama 3 counterpart in titanlite")
        rest = _LAYER_BACK[parts[3]]
        if rest == "attention.wq.weight":
            w = _to_pairs(w, args.n_heads)
        elif rest == "attention.wk.weight":
            w = _to_pairs(w, args.n_kv_heads)
        out[f"layers.{parts[2]}.{rest}"] = w
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    rope_scaling = None
    if args.rope_scaling_factor:
        rope_scaling = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                        "low_freq_factor": args.rope_low_freq_factor,
                        "high_freq_factor": args.rope_high_freq_factor,
                        "original_max_position_embeddings": args.rope_original_max_seq_len}
    # rope_theta / rope_scaling are the keys both transformers 4.x and 5.x read
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "rope_scaling": rope_scaling,
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def _ffn_args(dim: int, hidden: int) -> dict[str, Any]:
    """multiple_of / ffn_dim_multiplier that make ModelArgs.ffn_hidden equal `hidden`."""
    base = int(2 * 4 * dim / 3)
    if base <= hidden:
        return {"multiple_of": hidden, "ffn_dim_multiplier": None}  # rounds base up to exactly hidden
    return {"multiple_of": 1, "ffn_dim_multiplier": (hidden + 0.5) / base}


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    if cfg.get("model_type") != "llama":
        raise ConfigError(f"config.json model_type is '{cfg.get('model_type')}', not 'llama'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConfigError(f"config.json sets {key}; titanlite's Llama 3 has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act is '{cfg['hidden_act']}'; only silu is supported")
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise ConfigError(f"config.json head_dim {cfg['head_dim']} differs from hidden_size / "
                          f"num_attention_heads = {dim // n_heads}, which titanlite assumes")
    # transformers 5 nests rope_theta in rope_parameters; 4.x keeps rope_theta and rope_scaling apart
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = {}
    if rope_type == "llama3":
        scaling = dict(rope_scaling_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ConfigError(f"config.json rope type '{rope_type}' is not supported (default or llama3)")
    args = ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or n_heads, vocab_size=cfg["vocab_size"],
                     norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                     max_seq_len=cfg.get("max_position_embeddings", 2048),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     **_ffn_args(dim, cfg["intermediate_size"]), **scaling)
    if args.ffn_hidden != cfg["intermediate_size"]:
        raise ConfigError(f"config.json intermediate_size {cfg['intermediate_size']} cannot be expressed "
                          f"by titanlite's Llama 3 (got {args.ffn_hidden})")
    return args


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
