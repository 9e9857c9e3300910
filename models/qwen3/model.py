"""Qwen3 dense, as plain single-device PyTorch.

Differences from Llama 3: an explicit head_dim (q/k/v widths need not equal dim),
RMSNorm on each query and key head before RoPE (QK-norm), RoPE in the rotate-half layout
that Qwen's released weights use with float32 angles, and an explicit FFN width. The blocks
are built from titanlite.layers and stacked by `Decoder`. Parallelism lives in parallelize.py.
Read top to bottom.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanlite.layers import rope
from titanlite.layers.attention import Attention
from titanlite.layers.decoder import Block, Decoder, DecoderArgs
from titanlite.layers.feed_forward import FeedForward


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    head_dim: int = 128
    """Width of one attention head; Qwen3 sets it independently of dim / n_heads."""
    ffn_hidden: int = 12288
    """Width of the SwiGLU hidden layer (Hugging Face's intermediate_size)."""
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """One frequency per (i, i + head_dim/2) pair, in float32 like the reference implementation:
    in float64 the angles at large positions differ by up to ~1e-3 rad from those the released
    weights saw."""
    return rope.frequencies(args.head_dim, args.rope_theta, torch.float32)


def block(args: ModelArgs) -> Block:
    attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, rope.rotate_halves,
                          qk_norm_eps=args.norm_eps)
    return Block(args.dim, args.norm_eps, attention, feed_forward=FeedForward(args.dim, args.ffn_hidden, F.silu))


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: block(args), rope_frequencies(args))
