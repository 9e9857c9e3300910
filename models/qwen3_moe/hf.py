"""Qwen3-MoE <-> transformers' Qwen3MoeForCausalLM: parameter names and config.json.

Attention, norms and embeddings are named as in Qwen3 dense (titanlite.checkpoint.hf's shared
names). Experts differ in layout: titanlite keeps each layer's experts stacked,
`moe.experts.w1/w2/w3` of shape [num_experts, ...], while the saved Hugging Face format has one tensor per expert
(`mlp.experts.<e>.gate_proj/up_proj/down_proj.weight`; transformers 5 fuses them in memory
on load and splits them again on save). Both directions read and write the saved format;
the fused in-memory names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are read too.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titanlite.checkpoint.hf import (DECODER_LAYER, QK_NORM, HFAdapter, decoder_args, decoder_config, decoder_facts,
                                    on_meta, read_decoder_config, rename_from_hf, rename_to_hf)
from titanlite.errors import ConfigError
from titanlite.layers import rope
from titanlite.layers.moe import MoEArgs

from .model import ModelArgs, Transformer

# attention, norms and (in dense layers) the feed-forward are named as in Qwen3 dense
_LAYER = DECODER_LAYER | QK_NORM | {"moe.router.gate.weight": "mlp.gate.weight"}
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_BACK = {v: k for k, v in _EXPERT.items()}
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def _experts_to_hf(layer: str, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """moe.experts.w1/w2/w3 [num_experts, ...] -> one tensor per expert; the router bias has no
    counterpart, and is refused unless zero."""
    if name == "moe.router.expert_bias":
        if w.abs().max() > 0:
            raise ConfigError(f"layers.{layer}.{name} is non-zero (aux-loss-free balancing), but Qwen3MoeForCausalLM "
                              "has no router bias: the exported model would route differently")
        return {}
    hf_name = _EXPERT[name.rsplit(".", 1)[1]]
    return {f"model.layers.{layer}.mlp.experts.{e}.{hf_name}.weight": w[e] for e in range(w.shape[0])}


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full (unsharded) titanlite state dict -> the saved transformers names, one tensor per expert."""
    return rename_to_hf(state_dict, _LAYER, args.tie_embeddings, _experts_to_hf)


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers state dict (saved or in-memory names) -> titanlite names, experts stacked."""
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def take_experts(key: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if m := _PER_EXPERT.fullmatch(key):
            experts.setdefault((int(m[1]), _EXPERT_BACK[m[3]]), {})[int(m[2])] = w
            return {}  # stacked below, once every expert of the layer is read
        if m := _FUSED.fullmatch(key):
            if m[2] == "down_proj":
                return {f"layers.{m[1]}.moe.experts.w2": w}
            gate, up = w.chunk(2, dim=1)  # gate rows first, then up rows
            return {f"layers.{m[1]}.moe.experts.w1": gate, f"layers.{m[1]}.moe.experts.w3": up}
        return None

    out = rename_from_hf(state_dict, _LAYER, args.tie_embeddings, "Qwen3-MoE", take_experts)
    for (layer, name), per in experts.items():
        if sorted(per) != list(range(args.moe.num_experts)):
            raise ConfigError(f"layer {layer} has weights for experts {sorted(per)} of {name}; "
                              f"expected 0..{args.moe.num_experts - 1}")
        out[f"layers.{layer}.moe.experts.{name}"] = torch.stack([per[e] for e in range(len(per))])
    for layer in range(args.n_layers):
        if layer not in args.dense_layers:
            out[f"layers.{layer}.moe.router.expert_bias"] = torch.zeros(args.moe.num_experts)
    return out


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """ModelArgs -> config.json contents that transformers 4.x and 5.x both read."""
    if args.moe.shared_hidden or args.moe.score_func != "softmax":
        raise ConfigError("Qwen3MoeForCausalLM has softmax routing and no shared expert; "
                          "this model cannot be written in its format")
    facts = decoder_facts(on_meta(Transformer, args), "Qwen3MoeForCausalLM", _LAYER, rope.rotate_halves)
    return decoder_config(args, dtype, "Qwen3MoeForCausalLM", "qwen3_moe", use_sliding_window=False, **facts,
                          num_experts=args.moe.num_experts, num_experts_per_tok=args.moe.top_k,
                          moe_intermediate_size=args.moe.hidden, norm_topk_prob=args.moe.renormalize,
                          decoder_sparse_step=1, mlp_only_layers=list(args.dense_layers))


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """config.json contents -> ModelArgs; ConfigError for what this model cannot express."""
    rope = read_decoder_config(cfg, "qwen3_moe", "Qwen3-MoE", ("default",))
    if cfg.get("use_sliding_window"):
        raise ConfigError("config.json sets use_sliding_window; titanlite's Qwen3-MoE attends to the whole context")
    n_layers = cfg["num_hidden_layers"]
    # transformers 5 writes num_local_experts, 4.x num_experts
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    if not n_experts:
        dense = set(range(n_layers))
    dense |= {i for i in range(n_layers) if (i + 1) % step}
    moe = MoEArgs(num_experts=n_experts or 1, top_k=cfg.get("num_experts_per_tok", 1),
                  hidden=cfg.get("moe_intermediate_size", 0), renormalize=bool(cfg.get("norm_topk_prob", False)))
    return ModelArgs(**decoder_args(cfg, rope, 40960), ffn_hidden=cfg["intermediate_size"],
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                     moe=moe, dense_layers=tuple(sorted(dense)))


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
