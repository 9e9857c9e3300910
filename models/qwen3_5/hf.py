"""Qwen3.5 <-> transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (text only): parameter
names and config.json.

Where titanlite splits what Hugging Face fuses, so that tensor parallel splits each part by heads:
- full attention: HF's q_proj holds, per head, the query rows then the gate rows; titanlite
  keeps them as `wq` and `wg`;
- Gated DeltaNet: HF's in_proj_qkv and conv1d hold q, k, v channels one after the other;
  titanlite keeps `wq`, `wk`, `wv` and `conv_q`, `conv_k`, `conv_v` ([channels, kernel]).
Experts are stacked in titanlite and saved one tensor per expert (transformers 5 fuses them in
memory; both are read). The (1 + w) norms keep Hugging Face's w as they are. A checkpoint of the
vision-language model names its text weights model.language_model.*; they are read the same.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titanlite.checkpoint.hf import (ACTIVATIONS, TOP, HFAdapter, decoder_args, decoder_config, on_meta,
                                    read_decoder_config)
from titanlite.errors import ConfigError
from titanlite.layers.decoder import Block, Decoder
from titanlite.layers.feed_forward import FeedForward
from titanlite.layers.linear_attention import GatedDeltaNet
from titanlite.layers.moe import MoE, MoEArgs
from titanlite.layers.norm import OffsetRMSNorm

from .model import LAYER_TYPES, GatedAttention, ModelArgs, Transformer

_COMMON = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
           "feed_forward.w3.weight": "mlp.up_proj.weight", "moe.router.gate.weight": "mlp.gate.weight",
           "moe.shared.w1.weight": "mlp.shared_expert.gate_proj.weight",
           "moe.shared.w2.weight": "mlp.shared_expert.down_proj.weight",
           "moe.shared.w3.weight": "mlp.shared_expert.up_proj.weight",
           "moe.shared_gate.weight": "mlp.shared_expert_gate.weight"}
_FULL = {"attention.wk.weight": "self_attn.k_proj.weight", "attention.wv.weight": "self_attn.v_proj.weight",
         "attention.wo.weight": "self_attn.o_proj.weight", "attention.q_norm.weight": "self_attn.q_norm.weight",
         "attention.k_norm.weight": "self_attn.k_norm.weight"}
_LINEAR = {"attention.wz.weight": "linear_attn.in_proj_z.weight", "attention.wb.weight": "linear_attn.in_proj_b.weight",
           "attention.wa.weight": "linear_attn.in_proj_a.weight", "attention.dt_bias": "linear_attn.dt_bias",
           "attention.A_log": "linear_attn.A_log", "attention.norm.weight": "linear_attn.norm.weight",
           "attention.wo.weight": "linear_attn.out_proj.weight"}
_FUSED = {"full_attention": (("attention.wq.weight", "attention.wg.weight"), "self_attn.q_proj.weight"),
          "linear_attention": (("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
                               "linear_attn.in_proj_qkv.weight")}
_CONV = (("attention.conv_q", "attention.conv_k", "attention.conv_v"), "linear_attn.conv1d.weight")
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _names(kind: str) -> dict[str, str]:
    return _COMMON | (_FULL if kind == "full_attention" else _LINEAR)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full (unsharded) titanlite state dict -> the saved transformers names."""
    out = {TOP[k]: w for k, w in state_dict.items() if k in TOP and not (k == "output.weight" and args.tie_embeddings)}
    for i in range(args.n_layers):
        kind, pre = args.layer_type(i), f"model.layers.{i}."
        own = {k.split(".", 2)[2]: w for k, w in state_dict.items() if k.startswith(f"layers.{i}.")}
        (parts, fused) = _FUSED[kind]
        if kind == "full_attention":  # per head: its query rows, then its gate rows
            q, g = (own.pop(p).unflatten(0, (args.n_heads, args.head_dim)) for p in parts)
            out[pre + fused] = torch.cat([q, g], dim=1).flatten(0, 1)
        else:
            out[pre + fused] = torch.cat([own.pop(p) for p in parts])
            out[pre + _CONV[1]] = torch.cat([own.pop(p) for p in _CONV[0]])[:, None]
        if (bias := own.pop("moe.router.expert_bias", None)) is not None and bias.abs().max() > 0:
            raise ConfigError(f"layers.{i}.moe.router.expert_bias is non-zero (aux-loss-free balancing), but "
                              "Qwen3_5MoeForCausalLM has no router bias: the exported model would route differently")
        for name in ("w1", "w2", "w3"):
            if (w := own.pop(f"moe.experts.{name}", None)) is not None:
                out |= {f"{pre}mlp.experts.{e}.{_EXPERT[name]}.weight": w[e] for e in range(w.shape[0])}
        names = _names(kind)
        out |= {pre + names[k]: w for k, w in own.items()}
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers state dict (saved or in-memory names) -> titanlite names; a tied lm_head.weight
    is dropped; ConfigError for a weight titanlite has no place for."""
    top = {v: k for k, v in TOP.items()}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    out = {}
    for key, w in state_dict.items():
        key = key.replace("model.language_model.", "model.", 1)
        if key in top:
            if not (key == "lm_head.weight" and args.tie_embeddings):
                out[top[key]] = w
        elif (m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)) and int(m[1]) < args.n_layers:
            layers.setdefault(int(m[1]), {})[m[2]] = w
        else:
            raise ConfigError(f"Hugging Face weight '{key}' has no Qwen3.5 counterpart in titanlite (text only)")
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    for i, own in sorted(layers.items()):
        kind, pre = args.layer_type(i), f"layers.{i}."
        parts, fused = _FUSED[kind]
        if kind == "full_attention":
            q, g = own.pop(fused).unflatten(0, (args.n_heads, 2 * args.head_dim)).chunk(2, dim=1)
            out |= {pre + parts[0]: q.flatten(0, 1), pre + parts[1]: g.flatten(0, 1)}
        else:
            k, v = args.linear_k_heads * args.linear_k_head_dim, args.linear_v_heads * args.linear_v_head_dim
            out |= {pre + p: w for p, w in zip(parts, own.pop(fused).split([k, k, v]))}
            out |= {pre + p: w for p, w in zip(_CONV[0], own.pop(_CONV[1])[:, 0].split([k, k, v]))}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for key in [k for k in own if _PER_EXPERT.fullmatch(k)]:
            m = _PER_EXPERT.fullmatch(key)
            experts.setdefault(m[2], {})[int(m[1])] = own.pop(key)
        if (gate_up := own.pop("mlp.experts.gate_up_proj", None)) is not None:  # transformers 5, in memory
            gate, up = gate_up.chunk(2, dim=1)
            out |= {pre + "moe.experts.w1": gate, pre + "moe.experts.w3": up,
                    pre + "moe.experts.w2": own.pop("mlp.experts.down_proj")}
        for hf_name, per in experts.items():
            if args.moe is None or sorted(per) != list(range(args.moe.num_experts)):
                raise ConfigError(f"layer {i} has weights for experts {sorted(per)} of {hf_name}; expected "
                                  f"0..{args.moe.num_experts - 1 if args.moe else -1}")
            name = {v: k for k, v in _EXPERT.items()}[hf_name]
            out[f"{pre}moe.experts.{name}"] = torch.stack([per[e] for e in range(len(per))])
        back = {v: k for k, v in _names(kind).items()}
        for key, w in own.items():
            if key not in back:
                raise ConfigError(f"Hugging Face weight 'model.layers.{i}.{key}' has no Qwen3.5 {kind} "
                                  "counterpart in titanlite")
            out[pre + back[key]] = w
        if args.moe is not None:
            out[pre + "moe.router.expert_bias"] = torch.zeros(args.moe.num_experts)
    return out


def hidden_act(args: ModelArgs, architecture: str) -> str:
    """The activation config.json must name, read off the model this family builds, after refusing
    in one line what `architecture` cannot compute that the args do not show (a fork's edit to
    model.py): a top-level forward of its own, a block that is not titanlite's Block with (1 + w)
    norms, a mixer other than the layer type's, a weight it has no name for, a feed-forward other
    than FeedForward or MoE, or an activation with no transformers name."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{architecture} cannot express this model: {what}; export a model it can compute, "
                           "or write an adapter (models/<name>/hf.py) for an architecture that has it")

    model = on_meta(Transformer, args)
    if type(model).forward is not Decoder.forward:
        raise refuse(f"{type(model).__qualname__} overrides Decoder.forward")
    acts = set()
    for i, block in model.layers.items():
        kind = args.layer_type(int(i))
        mixer = GatedAttention if kind == "full_attention" else GatedDeltaNet
        norms = {type(m) for n, m in block.named_modules() if n in ("attention_norm", "ffn_norm")}
        if type(block) is not Block or type(block.attention) is not mixer or norms != {OffsetRMSNorm}:
            raise refuse(f"block {i} ({kind}) is {type(block).__qualname__} with {type(block.attention).__qualname__} "
                         f"and norms {sorted(t.__name__ for t in norms)}, not Block with {mixer.__name__} and "
                         "OffsetRMSNorm")
        known = set(_names(kind)) | set(_FUSED[kind][0]) | set(_CONV[0]) \
            | {f"moe.experts.{w}" for w in _EXPERT} | {"moe.router.expert_bias"}
        unknown = sorted(set(block.state_dict()) - known)
        if unknown:
            raise refuse(f"block {i} has '{unknown[0]}', which it has no name for")
        ffn = block.feed_forward if block.moe is None else block.moe.shared
        if block.moe is not None:
            if type(block.moe) is not MoE:
                raise refuse(f"block {i}'s moe is {type(block.moe).__qualname__}, not titanlite.layers.moe.MoE")
            acts.add("silu")  # the routed experts' gate (titanlite.layers.moe)
        if ffn is not None:
            if type(ffn) is not FeedForward or ffn.act not in ACTIVATIONS:
                raise refuse(f"block {i}'s feed-forward is {type(ffn).__qualname__} with activation "
                             f"{getattr(getattr(ffn, 'act', None), '__name__', None)}")
            acts.add(ACTIVATIONS[ffn.act])
    if len(acts) != 1:
        raise refuse(f"its blocks mix the activations {', '.join(sorted(acts))}; config.json has one hidden_act")
    return acts.pop()


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """ModelArgs -> the config.json of Qwen3_5ForCausalLM (dense) or Qwen3_5MoeForCausalLM."""
    moe = args.moe
    if moe is not None and (not moe.shared_hidden or not moe.shared_gate or moe.score_func != "softmax"
                            or not moe.renormalize):
        raise ConfigError("Qwen3_5MoeForCausalLM has a gated shared expert and renormalised softmax routing; "
                          "this model cannot be written in its format")
    layer_types = [args.layer_type(i) for i in range(args.n_layers)]
    extra: dict[str, Any] = dict(
        layer_types=layer_types, linear_num_key_heads=args.linear_k_heads, linear_num_value_heads=args.linear_v_heads,
        linear_key_head_dim=args.linear_k_head_dim, linear_value_head_dim=args.linear_v_head_dim,
        linear_conv_kernel_dim=args.conv_kernel,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta,
                         "partial_rotary_factor": args.rotary_fraction})
    if moe is None:
        return decoder_config(args, dtype, "Qwen3_5ForCausalLM", "qwen3_5_text",
                              hidden_act=hidden_act(args, "Qwen3_5ForCausalLM"), **extra)
    cfg = decoder_config(args, dtype, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text",
                         hidden_act=hidden_act(args, "Qwen3_5MoeForCausalLM"), num_experts=moe.num_experts,
                         num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.hidden,
                         shared_expert_intermediate_size=moe.shared_hidden, **extra)
    del cfg["intermediate_size"]
    return cfg


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """config.json contents (text config, or a vision-language one's text_config) -> ModelArgs;
    ConfigError for what this model cannot express."""
    cfg = cfg.get("text_config", cfg)
    moe_type = cfg.get("model_type") == "qwen3_5_moe_text"
    rope = read_decoder_config(cfg, "qwen3_5_moe_text" if moe_type else "qwen3_5_text", "Qwen3.5", ("default",))
    n_layers = cfg["num_hidden_layers"]
    layer_types = tuple(cfg.get("layer_types") or ())
    if len(layer_types) != n_layers or set(layer_types) - set(LAYER_TYPES):
        raise ConfigError(f"config.json layer_types must name each of its {n_layers} layers one of {LAYER_TYPES}")
    moe = None
    if moe_type:
        moe = MoEArgs(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                      hidden=cfg["moe_intermediate_size"], shared_hidden=cfg["shared_expert_intermediate_size"],
                      shared_gate=True)
    return ModelArgs(**decoder_args(cfg, rope, 32768), ffn_hidden=cfg.get("intermediate_size", 0) if not moe else 0,
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                     rotary_fraction=float(rope.get("partial_rotary_factor", 1.0)), layer_types=layer_types,
                     linear_k_heads=cfg["linear_num_key_heads"], linear_v_heads=cfg["linear_num_value_heads"],
                     linear_k_head_dim=cfg["linear_key_head_dim"], linear_v_head_dim=cfg["linear_value_head_dim"],
                     conv_kernel=cfg["linear_conv_kernel_dim"], moe=moe)


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf)
