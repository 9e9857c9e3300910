"""Qwen3 dense, as plain single-device PyTorch.

Differences from Llama 3: an explicit head_dim (q/k/v widths need not equal dim),
RMSNorm on each query and key head before RoPE, RoPE in the rotate-half layout
that Qwen's released weights use, and an explicit FFN width. Parallelism lives in
parallelize.py; attention goes through titanlite.layers.attention.sdpa. Read top to bottom.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.layers import init
from titanlite.layers.attention import AttnContext, sdpa


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    """Width of one attention head; Qwen3 sets it independently of dim / n_heads."""
    ffn_hidden: int = 12288
    """Width of the SwiGLU hidden layer (Hugging Face's intermediate_size)."""
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False


def rope_angles(args: ModelArgs) -> torch.Tensor:
    """[max_seq_len, head_dim/2] rotation angles, one frequency per (i, i + head_dim/2) pair.
    Computed in float32 like the reference implementation: in float64 the angles at
    large positions differ by up to ~1e-3 rad from those the released weights saw."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    return torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate element i with element i + D/2 (the rotate-half layout of Qwen's weights).
    x: [B, S, H, D]; cos/sin: [B or 1, S, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # QK-norm: one weight per head_dim element, shared by all heads
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
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
        angles = rope_angles(self.args)
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
