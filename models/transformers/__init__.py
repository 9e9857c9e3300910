"""Any transformers causal LM, trained as a titanlite family: the architecture and its code come
from transformers (model.hf_config: a folder with config.json, or a model_type with
model.hf_overrides), the parallel plan (translated from its base_model_tp_plan), initialisation,
checkpoints, the dry run and the checks from titanlite. docs/transformers_models.md."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cache

import torch

from titanlite.layers import decoder
from titanlite.layers.moe import AUX_LOSS
from titanlite.model_spec import ModelSpec

from .config import args_from_config, compare_saved, from_hf_config, notes, resolve_dict
from .hf import ADAPTER
from .model import ModelArgs, build, hf_config
from .parallelize import check_layout, tp_plan

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""The sizes of the debug flavors: a few hundred thousand parameters."""
_SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
DEBUG = {
    "llama": {},
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, tie_word_embeddings=True, **_SLIDING),
    "qwen3": dict(use_sliding_window=True, **_SLIDING),
    "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=30.0, query_pre_attn_scalar=16, **_SLIDING),
    "gemma3_text": dict(query_pre_attn_scalar=16, **_SLIDING),
    "phi3": dict(partial_rotary_factor=0.5),
    "olmo2": {},
    "olmo3": _SLIDING,
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.2),
    "smollm3": dict(no_rope_layer_interval=2, tie_word_embeddings=True),
    "glm4": dict(partial_rotary_factor=0.5),
    "starcoder2": dict(sliding_window=8, hidden_act="gelu_pytorch_tanh"),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # what the list above lacks: dropout in the published config (off here), q/k/v biases without o's
    "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),
    # LayerNorm, attention and MLP in parallel off one norm, a logit scale, a tied lm_head
    "cohere2": _SLIDING,
    # norms after attention and MLP (not before), QK-norm, windows on some layers
    "exaone4": _SLIDING,
    # a squared-ReLU MLP without a gate
    "arcee": {},
    # QK-norm after RoPE
    "hunyuan_v1_dense": {},
    # LayerNorm without parameters, q, k and v clipped (in place: under tensor parallel too)
    "olmo": dict(clip_qkv=0.2),
    # a mixture of experts with a router of its own (and a sliding window on every layer)
    # (and its load-balancing loss trained, at a weight its gradients show)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
                    output_router_logits=True, router_aux_loss_coef=0.5),
}
"""model_type -> what its debug flavor (debug_<model_type>) changes of TINY; every architecture
the parity test runs (tests/test_transformers_parity.py)."""


class Flavors(Mapping):
    """The debug flavors, each made (its transformers config resolved and checked) on first use:
    "debugmodel" is Llama's, "debug_<model_type>" each of DEBUG."""

    def __init__(self):
        self.names = ["debugmodel", *(f"debug_{t}" for t in DEBUG)]
        self.made: dict[str, ModelArgs] = {}

    def __getitem__(self, name: str) -> ModelArgs:
        if name not in self.names:
            raise KeyError(name)
        if name not in self.made:
            model_type = "llama" if name == "debugmodel" else name.removeprefix("debug_")
            self.made[name] = args_from_config(resolve_dict({"model_type": model_type, **TINY, **DEBUG[model_type]},
                                                            f"flavor {name}"))
        return self.made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@cache
def matmul_params(args: ModelArgs) -> int:
    """Weights a token's matmuls use (the blocks' and lm_head's; a MoE's routed experts at their
    activated share, top-k of all)."""
    config = hf_config(args)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    routed = getattr(config, "num_experts_per_tok", None)
    with torch.device("meta"):
        model = build(args)
    total = model.lm_head.weight.numel()
    for p in model.model.layers.parameters():
        if p.ndim == 3 and experts and routed and p.shape[0] == experts:
            total += p.numel() * routed // experts
        elif p.ndim >= 2:
            total += p.numel()
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    return decoder.flops_per_token(args, seq_len, matmul_params(args))


SPEC = ModelSpec(name="transformers", flavors=Flavors(), build=build, tp_plan=tp_plan, flops_per_token=flops_per_token,
                 check_layout=check_layout, hf=ADAPTER, blocks="model.layers", pre=("model.embed_tokens",),
                 post=("model.norm", "lm_head"), from_hf_config=from_hf_config, compare_saved=compare_saved,
                 extra_losses=(AUX_LOSS,), notes=notes)
