"""gpt-oss, as plain single-device PyTorch.

Every block is grouped-query attention with biases on q, k, v and the output, a learned sink
logit per query head, and a 128-key sliding window on alternate blocks (`layer_types`); then a
mixture of experts: a router with a bias whose softmax runs over the top k logits alone, experts
with biases and a clamped SwiGLU. RoPE is YaRN (float32, rotate-half layout, ramp not truncated).
All of it is built from titanlite.layers; `Decoder` stacks the blocks. Parallelism lives in
parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from titanlite.layers import rope
from titanlite.layers.attention import Attention
from titanlite.layers.decoder import Block, Decoder, DecoderArgs
from titanlite.layers.moe import MoE, MoEArgs


def gpt_oss_moe(num_experts: int, hidden: int = 2880, top_k: int = 4) -> MoEArgs:
    """The released experts: top 4 by the raw logits, SwiGLU with gain 1.702 clamped at 7."""
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden=hidden, score_func="topk_softmax",
                   router_bias=True, expert_biases=True, swiglu_limit=7.0, swiglu_alpha=1.702)


def alternating(n_layers: int) -> tuple[str, ...]:
    """The released layer_types: even blocks slide, odd blocks see the whole context."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    head_dim: int = 64
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    sliding_window: int = 128
    attn_sinks: bool = True
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32))
    yarn: rope.YaRN | None = rope.YaRN(factor=32.0, original_max_seq_len=4096, truncate=False)
    """YaRN context extension (config.json's rope_scaling); None: plain RoPE."""

    @property
    def ffn_hidden(self) -> int:
        """Each expert's width (config.json's intermediate_size); gpt-oss has no dense feed-forward."""
        return self.moe.hidden


def block(args: ModelArgs, layer: int) -> Block:
    attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, rope.rotate_halves,
                          window=args.window(layer), sinks=args.attn_sinks, bias=True)
    return Block(args.dim, args.norm_eps, attention, moe=MoE(args.dim, args.moe))


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        if args.yarn is None:
            freqs, scale = rope.frequencies(args.head_dim, args.rope_theta, torch.float32), 1.0
        else:
            freqs, scale = rope.yarn_frequencies(args.head_dim, args.rope_theta, args.yarn)
        super().__init__(args, lambda i: block(args, i), freqs, scale)

