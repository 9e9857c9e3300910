"""The one attention entry point that model code calls.

Models never know about context parallelism or document masking: they pass an
`AttnContext` through, and this function picks the right kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
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
