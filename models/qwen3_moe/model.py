"""Qwen3-MoE, as plain single-device PyTorch.

Qwen3 dense with the feed-forward of (by default) every block replaced by titanlite.layers.moe.MoE:
softmax router over 128 experts, top 8, top-k probabilities renormalised, no shared expert.
Attention (QK-norm, rotate-half RoPE in float32 angles) is Qwen3's, imported from that
family: the two families run the same attention by definition, and a fork of the dense family
that changes attention is a new family anyway. Parallelism lives in parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from titanlite.models.qwen3.model import Attention, FeedForward, rope_angles
from titanlite.layers import init
from titanlite.layers.attention import AttnContext
from titanlite.layers.moe import MoE, MoEArgs


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    ffn_hidden: int = 6144
    """Width of the dense feed-forward in `dense_layers` (Hugging Face's intermediate_size)."""
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=128, top_k=8, hidden=768))
    dense_layers: tuple[int, ...] = ()
    """Blocks with a dense feed-forward instead of experts (Hugging Face's mlp_only_layers)."""


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if layer_id in args.dense_layers:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        else:
            self.moe = MoE(args.dim, args.moe)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, ctx)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # a dict keeps parameter names stable if layers are ever removed (pipeline stages)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)

    def init_weights(self, seed: int) -> None:
        """Fill the RoPE tables, the router biases and every parameter this module holds (a
        pipeline stage holds some); call after `to_empty`. A value depends only on (seed, its
        name, its full shape), so expert shards draw the same values on any layout."""
        angles = rope_angles(self.args)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())
        for name, buf in self.named_buffers():
            if name.endswith(("expert_bias", "tokens_per_expert")):
                init.zeros_(buf)
        for name, param in self.named_parameters():
            name = init.canonical(name)
            if name.endswith("norm.weight"):
                init.ones_(param)
            elif name == "tok_embeddings.weight" and not self.args.tie_embeddings:
                init.normal_(param, name, seed, 1.0)
            elif name in ("tok_embeddings.weight", "output.weight"):
                # tied or not, drawn as the output's table, on whichever stage holds it
                init.normal_(param, "output.weight", seed, self.args.dim ** -0.5, cutoff=3.0)
            else:  # layers.<i>.<attention|feed_forward|moe>.[experts|shared|router].<w>[.weight]
                layer, linear = int(name.split(".")[1]), name.removesuffix(".weight").rsplit(".", 1)[-1]
                # second projections of each branch start smaller with depth, as in Qwen3 here
                out_std = 0.02 / (2 * (layer + 1)) ** 0.5
                init.normal_(param, name, seed, out_std if linear in ("wo", "w2", "w3") else 0.02, cutoff=3.0)

    def forward(self, tokens: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        """tokens: [B, S] (or hidden states [B, S, dim] on a later pipeline stage) -> logits."""
        if ctx is not None and ctx.positions is not None:
            cos, sin = self.rope_cos[ctx.positions], self.rope_sin[ctx.positions]
        else:
            cos, sin = self.rope_cos[: tokens.shape[1]][None], self.rope_sin[: tokens.shape[1]][None]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, ctx)
        return self.output(self.norm(h))
