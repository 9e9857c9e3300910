"""gpt-oss <-> transformers' GptOssForCausalLM: parameter names, the experts' layout, config.json,
and the MXFP4 experts of the published checkpoints.

titanlite keeps each layer's experts as nn.Linear-oriented stacks, gate and up apart
(`moe.experts.w1/w3` [E, hidden, dim], `w2` [E, dim, hidden], biases `b1/b3` [E, hidden], `b2`
[E, dim]). transformers holds them transposed, gate and up interleaved in one tensor
(`mlp.experts.gate_up_proj` [E, dim, 2 * hidden], gate in the even columns, up in the odd;
`down_proj` [E, hidden, dim]; `gate_up_proj_bias`, `down_proj_bias`). The published checkpoints
store the two weights in MXFP4 (`*_blocks`, `*_scales`, titanlite.checkpoint.mxfp4) in the
nn.Linear orientation, gate and up rows interleaved; import dequantises them (exactly: every
MXFP4 value is a bfloat16). Export writes transformers' unquantised names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from titanlite.checkpoint import mxfp4
from titanlite.checkpoint.hf import (DECODER_LAYER, HFAdapter, decoder_args, decoder_config, decoder_facts, on_meta,
                                    read_decoder_config, rename_from_hf, rename_to_hf)
from titanlite.errors import ConfigError
from titanlite.layers import rope

from .model import ModelArgs, Transformer, alternating, gpt_oss_moe

_ATTN = {k: v for k, v in DECODER_LAYER.items() if k.startswith("attention") or k.startswith("ffn_norm")}
_LAYER = (_ATTN | {k.replace(".weight", ".bias"): v.replace(".weight", ".bias") for k, v in _ATTN.items()
                   if k.startswith("attention.w")}
          | {"attention.sinks": "self_attn.sinks", "moe.router.gate.weight": "mlp.router.weight",
             "moe.router.gate.bias": "mlp.router.bias"})
_OURS = re.compile(r"layers\.(\d+)\.moe\.(experts\.[wb][123]|router\.expert_bias)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)")


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, n, ...] each -> [E, 2n, ...], gate and up rows alternating."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full (unsharded) titanlite state dict -> transformers' names and layouts (unquantised)."""
    experts: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for key, w in state_dict.items():
        if m := _OURS.fullmatch(key):
            experts.setdefault(m[1], {})[m[2].rpartition(".")[2]] = w
        else:
            rest[key] = w
    out = rename_to_hf(rest, _LAYER, args.tie_embeddings)
    for layer, e in experts.items():
        if e["expert_bias"].abs().max() > 0:
            raise ConfigError(f"layers.{layer}.moe.router.expert_bias is non-zero (aux-loss-free balancing), but "
                              "GptOssForCausalLM has no selection bias: the exported model would route differently")
        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj"] = _interleave(e["w1"], e["w3"]).transpose(1, 2).contiguous()
        out[prefix + "gate_up_proj_bias"] = _interleave(e["b1"], e["b3"])
        out[prefix + "down_proj"] = e["w2"].transpose(1, 2).contiguous()
        out[prefix + "down_proj_bias"] = e["b2"]
    return out


def _experts_from_hf(layer: str, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's transformers or MXFP4 expert tensors -> w1, w2, w3, b1, b2, b3."""
    out = {}
    for name, other in (("gate_up_proj", "down_proj"), ("down_proj", "gate_up_proj")):
        key = f"model.layers.{layer}.mlp.experts.{name}"
        if name + "_blocks" in got or name + "_scales" in got:
            if name + "_scales" not in got or name + "_blocks" not in got:
                half = "_scales" if name + "_blocks" in got else "_blocks"
                raise ConfigError(f"{key}{half}: missing beside its MXFP4 partner; the checkpoint is incomplete")
            weight = mxfp4.dequantize(got[name + "_blocks"], got[name + "_scales"], torch.bfloat16)  # (out, in)
        elif name in got:
            weight = got[name].transpose(1, 2)
        else:
            continue
        if name == "down_proj":
            out["w2"] = weight.contiguous()
        else:
            out["w1"], out["w3"] = weight[:, 0::2].contiguous(), weight[:, 1::2].contiguous()
    if "gate_up_proj_bias" in got:
        out["b1"], out["b3"] = got["gate_up_proj_bias"][:, 0::2], got["gate_up_proj_bias"][:, 1::2]
    if "down_proj_bias" in got:
        out["b2"] = got["down_proj_bias"]
    return {f"layers.{layer}.moe.experts.{k}": v for k, v in out.items()}


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers state dict (unquantised, or the published MXFP4 one) -> titanlite names."""
    experts: dict[str, dict[str, torch.Tensor]] = {}

    def take(key: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if m := _THEIRS.fullmatch(key):
            experts.setdefault(m[1], {})[m[2] + m[3]] = w
            return {}
        return None

    out = rename_from_hf(state_dict, _LAYER, args.tie_embeddings, "gpt-oss", take)
    for layer, got in experts.items():
        out |= _experts_from_hf(layer, got)
    for layer in range(args.n_layers):
        out[f"layers.{layer}.moe.router.expert_bias"] = torch.zeros(args.moe.num_experts)
    return out


def _yarn_to_hf(yarn: rope.YaRN | None) -> dict[str, Any] | None:
    if yarn is None:
        return None
    out = {"rope_type": "yarn", "factor": yarn.factor, "original_max_position_embeddings": yarn.original_max_seq_len,
           "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "truncate": yarn.truncate}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(yarn, key) is not None:
            out[key] = getattr(yarn, key)
    return out


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """ModelArgs -> config.json contents that transformers reads as GptOssConfig."""
    m = args.moe
    if (m.score_func, m.router_bias, m.expert_biases, m.shared_hidden) != ("topk_softmax", True, True, 0):
        raise ConfigError("GptOssForCausalLM routes by a softmax over the top-k biased logits to experts with "
                          "biases and no shared expert; this model cannot be written in its format")
    if not args.attn_sinks:
        raise ConfigError("GptOssForCausalLM has attention sinks in every layer; this model has none")
    layer_types = list(args.layer_types) or ["sliding_attention" if args.sliding_window else "full_attention"] * \
        args.n_layers
    facts = decoder_facts(on_meta(Transformer, args), "GptOssForCausalLM", _LAYER, rope.rotate_halves)
    return decoder_config(args, dtype, "GptOssForCausalLM", "gpt_oss", rope_scaling=_yarn_to_hf(args.yarn), **facts,
                          attention_bias=True, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
                          sliding_window=args.sliding_window or None, layer_types=layer_types,
                          swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha)


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """config.json contents (as transformers writes them, or as published) -> ModelArgs."""
    rope_cfg = read_decoder_config(cfg, "gpt_oss", "gpt-oss", ("yarn", "default"), biases=())
    if cfg.get("attention_bias") is False:
        raise ConfigError("config.json sets attention_bias false; titanlite's gpt-oss has biases on q, k, v, o")
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ConfigError(f"config.json quantization_config.quant_method is '{quant}'; gpt-oss reads mxfp4 "
                          "(dequantised on import) or unquantised weights")
    yarn = None
    if rope_cfg["rope_type"] == "yarn":
        yarn = rope.YaRN(factor=float(rope_cfg["factor"]),
                         original_max_seq_len=int(rope_cfg["original_max_position_embeddings"]),
                         beta_fast=float(rope_cfg.get("beta_fast", 32.0)),
                         beta_slow=float(rope_cfg.get("beta_slow", 1.0)), mscale=rope_cfg.get("mscale"),
                         mscale_all_dim=rope_cfg.get("mscale_all_dim"), truncate=bool(rope_cfg.get("truncate", True)),
                         attention_factor=rope_cfg.get("attention_factor"))
    n_layers = cfg["num_hidden_layers"]
    moe = dataclasses.replace(gpt_oss_moe(cfg.get("num_local_experts", 128), cfg["intermediate_size"],
                                          cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4))),
                              swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                              swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    return ModelArgs(**decoder_args(cfg, rope_cfg, 131072), head_dim=cfg.get("head_dim") or
                     cfg["hidden_size"] // cfg["num_attention_heads"], moe=moe, yarn=yarn,
                     sliding_window=cfg.get("sliding_window") or 0,
                     layer_types=tuple(cfg.get("layer_types") or alternating(n_layers)))


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
