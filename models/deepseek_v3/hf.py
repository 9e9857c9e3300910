"""DeepSeek-V3 <-> transformers' DeepseekV3ForCausalLM: parameter names and config.json.

Experts are stacked in titanlite (`moe.experts.w1/w2/w3` [num_experts, ...]) and saved one
tensor per expert (`mlp.experts.<e>.gate_proj/up_proj/down_proj.weight`; transformers 5 fuses
them in memory, names read too). The selection bias is `mlp.gate.e_score_correction_bias`.

DeepSeek's own releases are FP8: a Linear's `weight` is float8_e4m3 with a float32
`weight_scale_inv` per 128 x 128 block; they are dequantised on load. Their multi-token
prediction depth k is saved as block `n_layers + k` (enorm, hnorm, eh_proj, the block, then
shared_head.norm, with copies of the embedding and output head), which transformers skips;
titanlite reads and writes that layout.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titanlite.checkpoint.hf import (DECODER_LAYER, HFAdapter, decoder_args, decoder_config, decoder_facts,
                                    on_meta, read_decoder_config, rename_from_hf, rename_to_hf)
from titanlite.errors import ConfigError
from titanlite.layers.moe import MoEArgs
from titanlite.layers import rope
from titanlite.layers.rope import YaRN

from .model import MLA, ModelArgs, Transformer

FP8_BLOCK = 128
_LAYER = DECODER_LAYER | {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight", "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight", "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight", "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared.w3.weight": "mlp.shared_experts.up_proj.weight"}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_BACK = {v: k for k, v in _EXPERT.items()}
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """A float8 weight times its per-block scale (block FP8_BLOCK x FP8_BLOCK), in float32."""
    rows, cols = weight.shape
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale_inv.shape) != blocks:
        raise ConfigError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}; a {rows} x {cols} weight in "
                          f"{FP8_BLOCK} x {FP8_BLOCK} blocks needs {blocks}")
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale


def _dequantized(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in state_dict.items() if not k.endswith(".weight_scale_inv")}
    for key, scale in state_dict.items():
        if key.endswith(".weight_scale_inv"):
            name = key.removesuffix("_scale_inv")
            if name not in state_dict:
                raise ConfigError(f"{key} has no weight {name} to dequantise")
            out[name] = dequantize(state_dict[name], scale, name)
    return out


def _block_to_hf(prefix: str, rest: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One block entry (not in _LAYER: stacked experts) under `prefix` (model.layers.<i>.)."""
    hf_name = _EXPERT[rest.rsplit(".", 1)[1]]
    return {f"{prefix}mlp.experts.{e}.{hf_name}.weight": w[e] for e in range(w.shape[0])}


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full titanlite state dict -> the saved names; MTP depths as blocks n_layers + k."""
    main = {k: v for k, v in state_dict.items() if not k.startswith("mtp")}
    out = rename_to_hf(main, _LAYER, args.tie_embeddings,
                       lambda i, rest, w: _block_to_hf(f"model.layers.{i}.", rest, w))
    for key, w in state_dict.items():
        if not key.startswith("mtp."):
            continue  # mtp_embeddings.weight is tok_embeddings.weight
        _, k, rest = key.split(".", 2)
        prefix = f"model.layers.{args.n_layers + int(k)}."
        if rest in _MTP:
            out[prefix + _MTP[rest]] = w
        elif rest.removeprefix("block.") in _LAYER:
            out[prefix + _LAYER[rest.removeprefix("block.")]] = w
        else:
            out |= _block_to_hf(prefix, rest.removeprefix("block."), w)
    for k in range(args.mtp_layers):
        prefix = f"model.layers.{args.n_layers + k}."
        # copies, as the release stores them (safetensors refuses shared storage); a part of a
        # state dict (a LoRA export's single weights) maps what it holds
        for ours, theirs in (("tok_embeddings.weight", "embed_tokens.weight"), ("output.weight", "shared_head.head.weight")):
            if ours in state_dict:
                out[prefix + theirs] = state_dict[ours].clone()
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers or DeepSeek state dict (FP8 dequantised) -> titanlite names, experts stacked.
    MTP blocks the model has no depth for are skipped, as transformers skips them."""
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    mtp_back = {v: k for k, v in _MTP.items()}
    layer_back = {v: k for k, v in _LAYER.items()}

    def where(layer: int) -> str | None:
        """titanlite prefix of HF block `layer` (None: an MTP depth the model lacks)."""
        if layer < args.n_layers:
            return f"layers.{layer}."
        return f"mtp.{layer - args.n_layers}.block." if layer - args.n_layers < args.mtp_layers else None

    def take(key: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        m = _LAYER_KEY.fullmatch(key)
        if m is None:
            return None
        prefix = where(int(m[1]))
        if prefix is None or m[2] in _MTP_COPIES:
            return {}
        if prefix.startswith("mtp.") and m[2] in mtp_back:
            return {prefix.removesuffix("block.") + mtp_back[m[2]]: w}
        if m := _PER_EXPERT.fullmatch(key):
            experts.setdefault((where(int(m[1])), _EXPERT_BACK[m[3]]), {})[int(m[2])] = w
            return {}  # stacked below, once every expert of the layer is read
        if m := _FUSED.fullmatch(key):
            if m[2] == "down_proj":
                return {f"{prefix}moe.experts.w2": w}
            gate, up = w.chunk(2, dim=1)  # gate rows first, then up rows
            return {f"{prefix}moe.experts.w1": gate, f"{prefix}moe.experts.w3": up}
        name = key.split(".", 3)[3]
        if prefix.startswith("mtp.") and name in layer_back:
            return {prefix + layer_back[name]: w}
        return None  # a main block's entry: renamed by rename_from_hf

    out = rename_from_hf(_dequantized(state_dict), _LAYER, args.tie_embeddings, "DeepSeek-V3", take)
    for (prefix, name), per in experts.items():
        if sorted(per) != list(range(args.moe.num_experts)):
            raise ConfigError(f"{prefix} has weights for experts {sorted(per)} of {name}; "
                              f"expected 0..{args.moe.num_experts - 1}")
        out[f"{prefix}moe.experts.{name}"] = torch.stack([per[e] for e in range(len(per))])
    if args.mtp_layers and "tok_embeddings.weight" in out:
        out["mtp_embeddings.weight"] = out["tok_embeddings.weight"]
    return out


def config_to_hf(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """ModelArgs -> config.json contents (DeepSeek's own keys, which transformers reads)."""
    moe = args.moe
    if moe.score_func != "sigmoid" or not moe.shared_hidden or moe.shared_hidden % moe.hidden:
        raise ConfigError("DeepseekV3ForCausalLM has sigmoid routing and shared experts as wide as a whole "
                          "number of routed ones; this model cannot be written in its format")
    rope_scaling = None
    if args.yarn is not None:
        y = args.yarn
        rope_scaling = {"rope_type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.original_max_seq_len,
                        "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale,
                        "mscale_all_dim": y.mscale_all_dim}
    rotate = rope.rotate_pairs if args.rope_interleave else rope.rotate_halves
    facts = decoder_facts(on_meta(Transformer, args), "DeepseekV3ForCausalLM", _LAYER, rotate, (MLA,), forward=None,
                          complete=False)
    cfg = decoder_config(args, dtype, "DeepseekV3ForCausalLM", "deepseek_v3", rope_scaling, **facts,
                         moe_intermediate_size=moe.hidden, n_routed_experts=moe.num_experts,
                         n_shared_experts=moe.shared_hidden // moe.hidden, num_experts_per_tok=moe.top_k,
                         routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_group,
                         topk_group=moe.topk_group, norm_topk_prob=moe.renormalize, scoring_func="sigmoid",
                         topk_method="noaux_tc", first_k_dense_replace=args.n_dense_layers,
                         q_lora_rank=args.q_lora_rank or None, kv_lora_rank=args.kv_lora_rank,
                         qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
                         v_head_dim=args.v_head_dim, rope_interleave=args.rope_interleave,
                         num_nextn_predict_layers=args.mtp_layers)
    del cfg["head_dim"]  # transformers derives it (the RoPE part); ours is nope + rope
    return cfg


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """config.json contents -> ModelArgs; ConfigError for what this model cannot express."""
    rope = read_decoder_config(cfg, "deepseek_v3", "DeepSeek-V3", ("default", "yarn"))
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if cfg.get(key, want) != want:
            raise ConfigError(f"config.json {key} is {cfg[key]!r}; titanlite's DeepSeek-V3 supports {want!r} only")
    if cfg.get("tie_word_embeddings"):
        raise ConfigError("config.json ties the embeddings; DeepSeek-V3 models never do")
    yarn = None
    if rope["rope_type"] == "yarn":
        original = rope["original_max_position_embeddings"]
        yarn = YaRN(factor=rope.get("factor") or cfg["max_position_embeddings"] / original,
                    original_max_seq_len=original, beta_fast=rope.get("beta_fast") or 32.0,
                    beta_slow=rope.get("beta_slow") or 1.0, mscale=rope.get("mscale"),
                    mscale_all_dim=rope.get("mscale_all_dim"), truncate=rope.get("truncate", True))
    hidden = cfg["moe_intermediate_size"]
    moe = MoEArgs(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"], hidden=hidden,
                  shared_hidden=hidden * (cfg.get("n_shared_experts") or 0), score_func="sigmoid",
                  renormalize=bool(cfg.get("norm_topk_prob", True)), n_group=cfg.get("n_group") or 1,
                  topk_group=cfg.get("topk_group") or 1, routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                  aux_loss_per_sequence=bool(cfg.get("seq_aux", True)))
    return ModelArgs(**decoder_args(cfg, rope, 163840), ffn_hidden=cfg["intermediate_size"],
                     q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
                     qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                     v_head_dim=cfg["v_head_dim"], n_dense_layers=cfg.get("first_k_dense_replace") or 0,
                     moe=moe, yarn=yarn, rope_interleave=bool(cfg.get("rope_interleave", True)),
                     mtp_layers=cfg.get("num_nextn_predict_layers") or 0)


ADAPTER = HFAdapter(to_hf=to_hf, from_hf=from_hf, config_to_hf=config_to_hf, args_from_hf=args_from_hf,
                    optional=("mtp.",))
"""The MTP depths are optional: transformers' DeepseekV3ForCausalLM drops them on load and never saves them."""
