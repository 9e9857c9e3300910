"""Qwen3-MoE <-> transformers' Qwen3MoeForCausalLM: parameter names and config.json.

Attention, norms and embeddings map as in Qwen3 dense (models/qwen3/hf.py). Experts differ in
layout: titanlite keeps each layer's experts stacked, `moe.experts.w1/w2/w3` of shape
[num_experts, ...], while the saved Hugging Face format has one tensor per expert
(`mlp.experts.<e>.gate_proj/up_proj/down_proj.weight`; transformers 5 fuses them in memory
on load and splits them again on save). Both directions read and write the saved format;
the fused in-memory names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are read too.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titanlite.models.qwen3.hf import _LAYER as _DENSE_LAYER
from titanlite.models.qwen3.hf import _TOP
from titanlite.errors import ConfigError
from titanlite.checkpoint.hf import HFAdapter
from titanlite.layers.moe import MoEArgs

from .model import ModelArgs

_TOP_BACK = {v: k for k, v in _TOP.items()}
# attention, norms and (in dense layers) the feed-forward are named as in Qwen3 dense
_LAYER = dict(_DENSE_LAYER) | {"moe.router.gate.weight": "mlp.gate.weight"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_BACK = {v: k for k, v in _EXPERT.items()}
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full (unsharded) titanlite state dict -> the saved transformers names, one tensor per expert."""
    out = {}
    for key, w in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue
        if key in _TOP:
            out[_TOP[key]] = w
            continue
        _, layer, rest = key.split(".", 2)
        if rest == "moe.router.expert_bias":
            if w.abs().max() > 0:
                raise ConfigError(f"{key} is non-zero (aux-loss-free balancing), but Qwen3MoeForCausalLM "
                                  "has no router bias: the exported model would route differently")
            continue
        if rest.startswith("moe.experts."):
            name = _EXPERT[rest.rsplit(".", 1)[1]]
            for e in range(w.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"] = w[e]
            continue
        out[f"model.layers.{layer}.{_LAYER[rest]}"] = w
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers state dict (saved or in-memory names) -> titanlite names, experts stacked."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for key, w in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key in _TOP_BACK:
            if not (key == "lm_head.weight" and args.tie_embeddings):
                out[_TOP_BACK[key]] = w
            continue
        if m := _PER_EXPERT.fullmatch(key):
            experts.setdefault((int(m[1]), _EXPERT_BACK[m[3]]), {})[int(m[2])] = w
            continue
        if m := _FUSED.fullmatch(key):
            if m[2] == "down_proj":
                out[f"layers.{m[1]}.moe.experts.w2"] = w
            else:  # gate rows first, then up rows
                out[f"layers.{m[1]}.moe.experts.w1"], out[f"layers.{m[1]}.moe.experts.w3"] = w.chunk(2, dim=1)
            continue
        parts = key.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in _LAYER_BACK:
            raise ConfigError(f"Hugging Face weight '{key}' has no Qwen3-MoE counterpart in titanlite")
        out[f"layers.{parts[2]}.{_LAYER_BACK[parts[3]]}"] = w
    for (layer, name), per in experts.items():
        if sorted(per) != list(range(args.moe.num_experts)):
            raise ConfigError(f"layer {layer} has weights for experts {sorted(per)} of {name}; "
                              f"expected 0..{args.moe.num_experts - 1}")
        out[f"layers.{layer}.moe.experts.{name}"] = torch.stack([per[e] for e in range(len(per))])
    for layer in range(args.n_layers):
        if layer not in args.dense_layers:
            out[f"layers.{layer}.moe.router.expert_bias"] = torch.zeros(args.moe.num_experts)
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """ModelArgs -> config.json contents that transformers 4.x and 5.x both read."""
    if args.moe.shared_hidden or args.moe.score_func != "softmax":
        raise ConfigError("Qwen3MoeForCausalLM has softmax routing and no shared expert; "
                          "this model cannot be written in its format")
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "rope_scaling": None, "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "use_sliding_window": False, "num_experts": args.moe.num_experts,
            "num_experts_per_tok": args.moe.top_k, "moe_intermediate_size": args.moe.hidden,
            "norm_topk_prob": args.moe.renormalize, "decoder_sparse_step": 1,
            "mlp_only_layers": list(args.dense_layers), "torch_dtype": str(dtype).removeprefix("torch.")}


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """config.json contents -> ModelArgs; ConfigError for what this model cannot express."""
    if cfg.get("model_type") != "qwen3_moe":
        raise ConfigError(f"config.json model_type is '{cfg.get('model_type')}', not 'qwen3_moe'")
    if cfg.get("attention_bias"):
        raise ConfigError("config.json sets attention_bias; titanlite's Qwen3-MoE has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act is '{cfg['hidden_act']}'; only silu is supported")
    if cfg.get("use_sliding_window"):
        raise ConfigError("config.json sets use_sliding_window; titanlite's Qwen3-MoE attends to the whole context")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json rope type '{rope_type}' is not supported (default only)")
    n_layers, n_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    # transformers 5 writes num_local_experts, 4.x num_experts
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    if not n_experts:
        dense = set(range(n_layers))
    dense |= {i for i in range(n_layers) if (i + 1) % step}
    moe = MoEArgs(num_experts=n_experts or 1, top_k=cfg.get("num_experts_per_tok", 1),
                  hidden=cfg.get("moe_intermediate_size", 0), renormalize=bool(cfg.get("norm_topk_prob", False)))
    return ModelArgs(dim=cfg["hidden_size"], n_layers=n_layers, n_heads=n_heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
                     ffn_hidden=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                     norm_eps=cfg.get("rms_norm_eps", 1e-6),
                     rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                     max_seq_len=cfg.get("max_position_embeddings", 40960),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     moe=moe, dense_layers=tuple(sorted(dense)))


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
