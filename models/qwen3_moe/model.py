"""Qwen3-MoE, as plain single-device PyTorch.

Qwen3 dense with the feed-forward of (by default) every block replaced by titanlite.layers.moe.MoE:
softmax router over 128 experts, top 8, top-k probabilities renormalised, no shared expert.
Attention is Qwen3's (QK-norm, rotate-half RoPE with float32 angles), built from the same
titanlite.layers parts. The blocks are stacked by `Decoder`. Parallelism lives in parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from titanlite.layers import rope
from titanlite.layers.attention import Attention
from titanlite.layers.decoder import Block, Decoder, DecoderArgs
from titanlite.layers.feed_forward import FeedForward
from titanlite.layers.moe import MoE, MoEArgs


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    head_dim: int = 128
    ffn_hidden: int = 6144
    """Width of the dense feed-forward in `dense_layers` (Hugging Face's intermediate_size)."""
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=128, top_k=8, hidden=768))
    dense_layers: tuple[int, ...] = ()
    """Blocks with a dense feed-forward instead of experts (Hugging Face's mlp_only_layers)."""


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Qwen3's: float32, as the released weights were trained with."""
    return rope.frequencies(args.head_dim, args.rope_theta, torch.float32)


def block(args: ModelArgs, layer_id: int) -> Block:
    attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, rope.rotate_halves,
                          qk_norm_eps=args.norm_eps)
    if layer_id in args.dense_layers:
        return Block(args.dim, args.norm_eps, attention, feed_forward=FeedForward(args.dim, args.ffn_hidden, F.silu))
    return Block(args.dim, args.norm_eps, attention, moe=MoE(args.dim, args.moe))


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: block(args, i), rope_frequencies(args))
