"""Llama 3, as plain single-device PyTorch: its sizes and FFN width rule, RoPE with Llama 3.1
frequency scaling in Meta's adjacent-pairs layout, and the blocks built from titanlite.layers
(grouped-query attention, SwiGLU feed-forward) that `Decoder` stacks between the token embedding
and the output projection. Parallelism lives in parallelize.py. Read top to bottom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanlite.layers import rope
from titanlite.layers.attention import Attention
from titanlite.layers.decoder import Block, Decoder, DecoderArgs
from titanlite.layers.feed_forward import FeedForward


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_theta: float = 500000.0
    max_seq_len: int = 131072
    rope_scaling_factor: float = 0.0
    """Llama 3.1 frequency scaling; 0 turns it off."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Per-pair rotation frequencies in float64, with Llama 3.1 scaling of the low frequencies."""
    freqs = rope.frequencies(args.head_dim, args.rope_theta, torch.float64)
    if args.rope_scaling_factor:
        freqs = rope.llama3_scaling(freqs, args.rope_scaling_factor, args.rope_low_freq_factor,
                                    args.rope_high_freq_factor, args.rope_original_max_seq_len)
    return freqs


def block(args: ModelArgs, layer: int) -> Block:
    attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, rope.rotate_pairs,
                          window=args.window(layer), sinks=args.attn_sinks)
    return Block(args.dim, args.norm_eps, attention, feed_forward=FeedForward(args.dim, args.ffn_hidden, F.silu))


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: block(args, i), rope_frequencies(args))
