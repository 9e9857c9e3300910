"""Llama 3, as plain single-device PyTorch.

Parallelism lives in parallelize.py; attention goes through titanlite.layers.attention.sdpa,
which handles context parallelism and masking. Read top to bottom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.layers import init
from titanlite.layers.attention import AttnContext, sdpa


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling_factor: float = 0.0
    """Llama 3.1 frequency scaling; 0 turns it off."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 131072
    tie_embeddings: bool = False

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
    """Per-pair rotation frequencies, with Llama 3.1 scaling of the low frequencies."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_scaling_factor:
        wavelen = 2 * math.pi / freqs
        low_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
        high_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
        smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor)
        blended = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / args.rope_scaling_factor,
                            torch.where(wavelen < high_wavelen, freqs, blended))
    return freqs


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (Meta's layout). x: [B, S, H, D]; cos/sin: [B or 1, S, 1, D/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, ctx)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # a dict keeps parameter names stable if layers are ever removed (pipeline stages)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)

    def init_weights(self, seed: int) -> None:
        """Fill the RoPE tables and every parameter this module holds (a pipeline stage holds
        some); call after `to_empty`. A value depends only on (seed, its name, its shape)."""
        angles = torch.outer(torch.arange(self.args.max_seq_len, dtype=torch.float64), rope_frequencies(self.args))
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())
        for name, param in self.named_parameters():
            name = init.canonical(name)
            if name.endswith("norm.weight"):
                init.ones_(param)
            elif name == "tok_embeddings.weight" and not self.args.tie_embeddings:
                init.normal_(param, name, seed, 1.0)
            elif name in ("tok_embeddings.weight", "output.weight"):
                # tied or not, drawn as the output's table, on whichever stage holds it
                init.normal_(param, "output.weight", seed, self.args.dim ** -0.5, cutoff=3.0)
            else:  # layers.<i>.<attention|feed_forward>.<linear>.weight
                layer, linear = int(name.split(".")[1]), name.split(".")[-2]
                # deeper blocks write smaller updates so the residual stream does not grow with depth
                out_std = 0.02 / (2 * (layer + 1)) ** 0.5
                init.normal_(param, name, seed, out_std if linear in ("wo", "w2", "w3") else 0.02, cutoff=3.0)

    def forward(self, tokens: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        """tokens: [B, S] -> logits [B, S, vocab]."""
        if ctx is not None and ctx.positions is not None:
            cos, sin = self.rope_cos[ctx.positions], self.rope_sin[ctx.positions]
        else:
            cos, sin = self.rope_cos[: tokens.shape[1]][None], self.rope_sin[: tokens.shape[1]][None]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, ctx)
        return self.output(self.norm(h))
