"""Qwen3.5 (dense and MoE, text only), as plain single-device PyTorch.

A hybrid: most blocks mix tokens with Gated DeltaNet (titanlite.layers.linear_attention, the
gated delta rule after a causal short convolution), every fourth with gated full attention.
What differs from Qwen3:
- `layer_types` names each block "linear_attention" or "full_attention" (Hugging Face's names);
- full attention is gated: the query projection's twin `wg` gives a per-channel sigmoid gate on
  the attention output; RoPE rotates only the first `rotary_fraction` of each head (rotate-half
  layout) and leaves the rest as it is; QK-norm as in Qwen3;
- every RMSNorm but the one inside Gated DeltaNet scales by (1 + w) (titanlite.layers.norm);
- the MoE flavors gate their shared expert by sigmoid(shared_gate x) (titanlite.layers.moe).
Blocks are `Block`s stacked by `Decoder`. Parallelism lives in parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.layers import init, rope
from titanlite.layers.attention import AttnContext, attention
from titanlite.layers.decoder import Block, Decoder, DecoderArgs
from titanlite.layers.feed_forward import FeedForward
from titanlite.layers.linear_attention import GatedDeltaNet
from titanlite.layers.moe import MoE, MoEArgs
from titanlite.layers.norm import OffsetRMSNorm

LAYER_TYPES = ("linear_attention", "full_attention")


def hybrid_layers(n_layers: int, full_every: int = 4) -> tuple[str, ...]:
    """Qwen3.5's pattern: (full_every - 1) linear blocks, then a full-attention one, repeated."""
    return tuple("full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(n_layers))


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    head_dim: int = 256
    ffn_hidden: int = 12288
    """Width of the dense SwiGLU (Hugging Face's intermediate_size); unused when `moe` is set."""
    vocab_size: int = 248320
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 32768
    rotary_fraction: float = 0.25
    """Share of each full-attention head RoPE rotates (Hugging Face's partial_rotary_factor)."""
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_k_head_dim: int = 128
    linear_v_head_dim: int = 128
    conv_kernel: int = 4
    chunk_size: int = 64
    """Tokens per chunk of the gated delta rule (memory [chunk, chunk] per chunk and head)."""
    linear_backend: str = "torch"
    """"torch" (plain PyTorch) or "fla" (flash-linear-attention; titanlite.layers.linear_attention)."""
    moe: MoEArgs | None = None
    """Every block's feed-forward is this MoE (Qwen3.5-MoE); None: dense."""
    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_TYPES

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else hybrid_layers(layer + 1)[layer]


class GatedAttention(nn.Module):
    """Qwen3.5's full attention: grouped-query attention whose output is gated per channel by
    sigmoid(wg x), QK-norm with (1 + w), RoPE on the first `rotary_dim` dims of each head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim, self.rotary_dim = args.head_dim, args.rotary_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wg = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = OffsetRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = OffsetRMSNorm(args.head_dim, eps=args.norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([rope.rotate_halves(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx, layer=self)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out * torch.sigmoid(self.wg(x)))


def block(args: ModelArgs, layer: int) -> Block:
    kind = args.layer_type(layer)
    if kind == "full_attention":
        mixer: nn.Module = GatedAttention(args)
    elif kind == "linear_attention":
        mixer = GatedDeltaNet(args.dim, args.linear_k_heads, args.linear_v_heads, args.linear_k_head_dim,
                              args.linear_v_head_dim, args.conv_kernel, args.norm_eps, args.chunk_size,
                              args.linear_backend)
    else:
        raise ValueError(f"layer_types[{layer}] is {kind!r}, not one of {LAYER_TYPES}")
    if args.moe is not None:
        return Block(args.dim, args.norm_eps, mixer, moe=MoE(args.dim, args.moe), norm=OffsetRMSNorm)
    return Block(args.dim, args.norm_eps, mixer, feed_forward=FeedForward(args.dim, args.ffn_hidden, F.silu),
                 norm=OffsetRMSNorm)


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        # float32 frequencies over the rotated dims only, as the reference computes them
        super().__init__(args, lambda i: block(args, i), rope.frequencies(args.rotary_dim, args.rope_theta,
                                                                        torch.float32), norm=OffsetRMSNorm)

    def init_weights(self, seed: int) -> None:
        """Decoder's draws, then what is Qwen3.5's own: (1 + w) norms start at zero (scale one);
        Gated DeltaNet's decay rates A = exp(A_log) are drawn in [1, 16] and its dt_bias starts
        at one (Hugging Face's init), its convolutions at N(0, 1/kernel) (a fan-in scale: at the
        linear layers' 0.02 they would all but erase q, k and v)."""
        super().init_weights(seed)
        for name, module in self.named_modules():
            if isinstance(module, OffsetRMSNorm):
                init.zeros_(module.weight)
            elif isinstance(module, GatedDeltaNet):
                init.uniform_(module.A_log, f"{name}.A_log", seed, 1.0, 16.0)
                with torch.no_grad():
                    module.A_log.log_()
                init.ones_(module.dt_bias)
                for conv in ("conv_q", "conv_k", "conv_v"):
                    weight = module.get_parameter(conv)
                    init.normal_(weight, f"{name}.{conv}", seed, weight.shape[1] ** -0.5, cutoff=3.0)
