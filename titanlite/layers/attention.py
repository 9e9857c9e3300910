"""The one attention entry point that model code calls, and the attention layer built on it.

Models never know about context parallelism or document masking: they pass an
`AttnContext` through, and `sdpa` picks the right kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from titanlite.parallel.context import chunks_of, gather_sequence


@dataclass
class AttnContext:
    """Per-batch attention facts the trainer knows and the model doesn't."""

    positions: torch.Tensor | None = None
    """[batch, seq] RoPE position of each of this rank's tokens; None means 0..seq-1."""
    document_ids: torch.Tensor | None = None
    """[batch, full seq] document of every token of the whole (unsharded) sequence;
    attention never crosses a document. None: one causal stream."""
    cp_group: dist.ProcessGroup | None = None
    """The context-parallel group when this rank holds a head-tail shard of the sequence;
    positions are then required (each token's global position)."""
    dtype: torch.dtype = torch.float32
    """dtype of q, k and v in attention (the parameter dtype), which the masks are built in."""
    blocks: list[tuple[slice, int, torch.Tensor | None]] | None = None
    """Derived: (query rows, key count, additive mask or None for plain causal) per query
    chunk. Built once per batch in `dtype` and shared by all layers: SDPA would turn a
    boolean mask into a float copy per call and keep that for backward, layer after layer.
    FSDP's input casting copies the context per block, blocks included."""

    def __post_init__(self) -> None:
        if self.blocks is not None or (self.cp_group is None and self.document_ids is None):
            return
        if self.cp_group is not None and self.positions is None:
            raise ValueError("AttnContext: a cp_group needs the positions of the rank's tokens")
        ref = self.positions if self.positions is not None else self.document_ids
        self.blocks = _blocks(self, ref.shape[-1], ref.device)


def _blocks(ctx: AttnContext, local_len: int, device: torch.device) -> list:
    if ctx.cp_group is None:
        spans = [(slice(0, local_len), 0)]
    else:
        degree, rank = dist.get_world_size(ctx.cp_group), dist.get_rank(ctx.cp_group)
        c = local_len // 2
        spans = [(slice(j * c, (j + 1) * c), chunk * c) for j, chunk in enumerate(chunks_of(rank, degree))]
    out = []
    for rows, start in spans:
        n_q = rows.stop - rows.start
        n_k = start + n_q  # causal: keys up to this chunk's last query
        if ctx.document_ids is None and start == 0:
            out.append((rows, n_k, None))
            continue
        q_pos = torch.arange(start, n_k, device=device)
        mask = (torch.arange(n_k, device=device)[None, :] <= q_pos[:, None])[None, None]
        if ctx.document_ids is not None:
            docs = ctx.document_ids.to(device)
            mask = mask & (docs[:, start:n_k, None] == docs[:, None, :n_k])[:, None]
        additive = torch.zeros(mask.shape, dtype=ctx.dtype, device=device).masked_fill_(~mask, float("-inf"))
        out.append((rows, n_k, additive))
    return out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
    """Causal attention. q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] with Hq a multiple of Hkv.

    With ctx.cp_group, S is this rank's head-tail shard: K and V are all-gathered (before
    the GQA expansion, to move less) and each of the two query chunks attends to the keys
    up to its own global position."""
    if ctx is None or (ctx.cp_group is None and ctx.document_ids is None):
        return _attend(q, k, v, None)
    if ctx.cp_group is not None:
        kv = gather_sequence(torch.stack([k, v]), ctx.cp_group, dim=3)
        k, v = kv[0], kv[1]
    outs = [_attend(q[:, :, rows], k[:, :, :n_k], v[:, :, :n_k], mask)
            for rows, n_k, mask in ctx.blocks]
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA; mask None means causal with queries and keys starting together."""
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)  # only if the context's dtype was wrong: correct, but a copy per layer
    rep = q.shape[1] // k.shape[1]
    # Flash kernels read shared K/V heads in place (no expanded copy, no sum over the copies
    # in backward). CUDA has flash only for 16-bit dtypes and without a mask; elsewhere it picks
    # the memory-efficient kernel, which has no GQA and would fall back to the math kernel.
    if mask is None and (q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
    if rep > 1:
        k = k.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
        v = v.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [B, S, H, D], cos, sin) -> x rotated: titanlite.layers.rope.rotate_pairs or rotate_halves."""


class Attention(nn.Module):
    """Grouped-query attention with RoPE: n_heads query heads share n_kv_heads key/value heads.
    With `qk_norm_eps`, each query and key head is RMS-normalised before RoPE (Qwen3's QK-norm:
    one weight of head_dim elements, shared by all heads)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rotate: Rotation,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotate = rotate
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = None if qk_norm_eps is None else nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else nn.RMSNorm(head_dim, eps=qk_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
