"""DeepSeek-V3 (and Kimi K2, Moonlight), as plain single-device PyTorch.

Multi-head latent attention (MLA): queries from x directly or through a low-rank bottleneck
(q_lora_rank) with its norm; keys and values from one compressed latent (kv_lora_rank) with
its norm, expanded per head into a position-free key part (qk_nope_head_dim) and the value
(v_head_dim); one RoPE key part (qk_rope_head_dim) computed from x and shared by every head.
Trained non-absorbed: the per-head keys and values are materialised and go through the
attention seam, whose q/k head dim (nope + rope) differs from v's. YaRN scales the RoPE tables
(its attention factor) and the softmax scale (mscale_all_dim).

Feed-forward: the first `n_dense_layers` blocks dense, the others MoE (titanlite.layers.moe)
with sigmoid scores, the aux-loss-free selection bias, group-limited routing, the routed
scaling factor and shared experts. After the blocks, optional multi-token prediction
(titanlite.layers.mtp). Parallelism lives in parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.layers import rope
from titanlite.layers.attention import AttnContext, Rotation, attention, masked_attention
from titanlite.layers.decoder import Block, Decoder, DecoderArgs
from titanlite.layers.feed_forward import FeedForward
from titanlite.layers.moe import MoE, MoEArgs
from titanlite.layers.mtp import MTPModule, mtp_loss
from titanlite.loss import ExtraLosses

LATENT_NORM_EPS = 1e-6
"""transformers' DeepSeek-V3 builds the q and kv latent norms with their default eps, not rms_norm_eps."""


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    q_lora_rank: int = 1536
    """Width of the query bottleneck; 0: queries projected from x directly."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    ffn_hidden: int = 18432
    """Width of the dense feed-forward of the first n_dense_layers blocks (intermediate_size)."""
    n_dense_layers: int = 3
    """first_k_dense_replace."""
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(
        num_experts=256, top_k=8, hidden=2048, shared_hidden=2048, score_func="sigmoid", n_group=8, topk_group=4,
        routed_scaling_factor=2.5))
    yarn: rope.YaRN | None = None
    rope_interleave: bool = True
    """RoPE on adjacent pairs (DeepSeek's released weights); False: on halves."""
    mtp_layers: int = 0
    """Multi-token prediction depths (num_nextn_predict_layers)."""
    mtp_loss_weight: float = 0.3
    """lambda: the MTP loss term is lambda / depths x the depths' summed token losses."""
    norm_eps: float = 1e-6
    vocab_size: int = 129280
    max_seq_len: int = 163840

    @property
    def head_dim(self) -> int:
        """The query/key head dim (nope + rope parts)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLA(nn.Module):
    """Multi-head latent attention, non-absorbed. Parameter names follow TorchTitan's
    (wq or wq_a/q_norm/wq_b, wkv_a, kv_norm, wkv_b, wo)."""

    def __init__(self, args: ModelArgs, rotate: Rotation):
        super().__init__()
        self.nope, self.rope, self.v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.rotate = rotate
        self.scale = args.head_dim ** -0.5 * rope.yarn_softmax_factor(args.yarn)
        q_out = args.n_heads * args.head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope + self.v), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v, args.dim, bias=False)
        # where the RoPE key shared by all heads meets the per-head keys: nothing on one device;
        # tensor parallel sums its gradient over the ranks' heads here (parallelize.py)
        self.k_rope_heads = nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism each rank holds only its share of heads
        q_nope, q_rope = q.view(bsz, seqlen, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.wkv_a.out_features - self.rope, self.rope], dim=-1)
        latent, k_rope = self.kv_norm(latent), self.rotate(k_rope.unsqueeze(2), cos, sin)
        past = None if ctx is None else ctx.past
        if past is not None:  # generation caches the latent and the RoPE key, not the expanded heads
            seen, index = past.extend(self, None, latent=latent, k_rope=k_rope)
            latent, k_rope = seen["latent"], seen["k_rope"]
        kv = self.wkv_b(latent).view(bsz, latent.shape[1], -1, self.nope + self.v)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        k_rope = self.k_rope_heads(k_rope).expand(-1, -1, k_nope.shape[2], -1)
        q = torch.cat([q_nope, self.rotate(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past is None:
            out = attention(q, k, v, ctx, scale=self.scale)
        else:
            out = masked_attention(q, k, v, past.mask(index, seqlen, None), None, self.scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def block(args: ModelArgs, layer_id: int) -> Block:
    rotate = rope.rotate_pairs if args.rope_interleave else rope.rotate_halves
    attention_ = MLA(args, rotate)
    if layer_id < args.n_dense_layers:
        return Block(args.dim, args.norm_eps, attention_, feed_forward=FeedForward(args.dim, args.ffn_hidden, F.silu))
    return Block(args.dim, args.norm_eps, attention_, moe=MoE(args.dim, args.moe))


def rope_frequencies(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """float32 frequencies of the RoPE part, and YaRN's factor on the tables (1 without YaRN)."""
    if args.yarn is None:
        return rope.frequencies(args.qk_rope_head_dim, args.rope_theta, torch.float32), 1.0
    return rope.yarn_frequencies(args.qk_rope_head_dim, args.rope_theta, args.yarn)


class Transformer(Decoder):
    """Decoder of MLA blocks, then (mtp_layers > 0) the multi-token prediction depths, whose
    embedding `mtp_embeddings` is tied to tok_embeddings (nn.Identity without MTP)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: block(args, i), *rope_frequencies(args))
        self.mtp = nn.ModuleDict({str(k): MTPModule(args.dim, args.norm_eps, block(args, args.n_layers + k))
                                  for k in range(args.mtp_layers)})
        self.mtp_embeddings: nn.Module = nn.Identity()
        if args.mtp_layers:
            self.mtp_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.mtp_embeddings.weight = self.tok_embeddings.weight
        self.extra_losses: ExtraLosses | None = None
        """Where the MTP loss goes: the training step's (bound by the step), None outside one."""

    def block_depth(self, name: str) -> int | None:
        """MTP depth k is drawn as block n_layers + k."""
        head, _, rest = name.partition(".")
        if head == "mtp":
            return self.args.n_layers + int(rest.partition(".")[0])
        return super().block_depth(name)

    def init_rule(self, name: str) -> tuple[str, float | None, float | None]:
        """Decoder's rule; the tied MTP embedding is drawn as tok_embeddings (a pipeline's last
        stage holds it alone)."""
        return super().init_rule("tok_embeddings.weight" if name == "mtp_embeddings.weight" else name)

    def forward(self, tokens: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        """tokens: [B, S] (or hidden states [B, S, dim] on a later pipeline stage) -> logits."""
        h, cos, sin = self.hidden(tokens, ctx)
        # nn.Identity before the last stage; generation (a cache) predicts with the blocks alone
        if isinstance(self.mtp, nn.ModuleDict) and len(self.mtp) and (ctx is None or ctx.past is None):
            ids = tokens if not tokens.is_floating_point() else getattr(ctx, "tokens", None)
            if ids is None:
                raise ValueError("multi-token prediction on a later pipeline stage needs AttnContext.tokens")
            h = mtp_loss(self.mtp, h, ids, ctx, cos, sin, self.mtp_embeddings,
                         lambda m, x: self.output(m.norm(x)), self.args.mtp_loss_weight, self.extra_losses)
        return self.output(self.norm(h))
