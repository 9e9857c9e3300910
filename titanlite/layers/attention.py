"""The attention seam (`attention`), the one function model code calls, and the grouped-query
attention layer built on it.

A model states what each layer wants: a sliding window of W keys, learned per-head sinks, a
softmax scale, and q/k may have another head dim than v (MLA). The trainer states, once, how
attention runs (`AttnSetup`: the backend, the model's windows, the context-parallel shards) and,
per batch, what the batch is (`AttnContext`: positions, packed documents).
Masks are the seam's business; no model builds one, and no mask of shape [queries, all keys]
outlives one block of queries.

A query at global index i sees key j iff j <= i, j is in i's document, and i - j < W.
Backends (`model.attn_backend`, docs/attention.md):
- sdpa: plain causal attention is one SDPA call (flash kernels). Anything else (documents,
  windows, sinks, context-parallel chunks) runs in blocks of `QUERY_BLOCK` queries, each
  against the keys up to its end (from its window's start), with a boolean mask of that block
  alone, recomputed in backward, so memory grows linearly with the sequence. Key ranges never
  depend on the data, so compiled blocks keep static shapes and the step reads nothing back. A sink is one more key whose score is the sink's
  logit and whose value is zero.
- flex: FlexAttention, one block mask per (query chunk, window) built on first use in a batch
  and shared by every layer and by the recompute under AC; compiled on GPU. torch has no
  FlexAttention backward on CPU, so there it serves forward passes only (preflight refuses
  training with it on CPU). Sinks scale the output by sigmoid(lse - sink).
- varlen: the CUDA variable-length kernel over packed documents (CUDA only; never run here).
Generation (AttnContext.past, titanlite.layers.cache): the calling layer's past keys and values
(a ring of W for a window) join this forward's, and one masked SDPA call runs the new queries.
Context parallel: K and V are all-gathered over the cp group (their gradients reduce-scattered
back) and each of the rank's two head-tail query chunks attends to the keys up to its end.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from titanlite.config.job import CHOICES

if TYPE_CHECKING:
    from titanlite.layers.cache import Cache

BACKENDS = CHOICES["model.attn_backend"]
QUERY_BLOCK = 512
"""Queries per masked SDPA call: bounds a block's mask (and the math kernel's scores) at
QUERY_BLOCK x its keys."""


class _BatchCache:
    """What every layer of one forward shares: flex's block masks. Not a tensor, container or
    dataclass: FSDP's input casting copies the context per block and keeps this by reference."""

    def __init__(self) -> None:
        self.items: dict = {}

    def get(self, key, build: Callable):
        if key not in self.items:
            self.items[key] = build()
        return self.items[key]


class SequenceShards(Protocol):
    """This rank's share of the sequence under context parallel: two head-tail chunks of
    2 x degree (titanlite.parallel.context.ContextParallel, bound when the model is parallelized)."""

    def chunks(self) -> tuple[int, int]:
        """The global indices of this rank's two chunks."""

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence along `dim`, in order, from every rank's chunks (backward: each
        rank's gradient back to it)."""

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunks of a whole sequence along `dim`."""

    def gather_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """x: [2, ...], one piece per local chunk (head, tail); every chunk's piece, [2 x degree,
        ...] in sequence order (backward: each piece's gradient summed back to its rank)."""


@dataclass(frozen=True)
class AttnSetup:
    """The static facts of a model's attention, bound once for the run: the backend, the
    model's windows and, under context parallel, the sequence's shards."""

    backend: str = "sdpa"
    """"sdpa", "flex" or "varlen" (see the module doc)."""
    windows: tuple[int | None, ...] = ()
    """The model's windows: with them, flex's block masks are built as a batch's context is made
    (outside compiled blocks, once per batch)."""
    cp: SequenceShards | None = None
    """This rank's head-tail shard of the sequence under context parallel; the batch's positions
    are then required (each token's global position)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"AttnSetup: backend {self.backend!r} is not one of {BACKENDS}")

    def context(self, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                seq_len: int = 0, device: torch.device | None = None,
                tokens: torch.Tensor | None = None) -> AttnContext:
        """One batch's attention context under this setup."""
        return AttnContext(positions, document_ids, tokens, self, seq_len, device)


@dataclass
class AttnContext:
    """Per-batch attention facts the trainer knows and the model doesn't; `setup` holds the
    static ones."""

    positions: torch.Tensor | None = None
    """[batch, seq] RoPE position of each of this rank's tokens; None means 0..seq-1."""
    document_ids: torch.Tensor | None = None
    """[batch, full seq] document of every token of the whole (unsharded) sequence;
    attention never crosses a document. None: one causal stream."""
    tokens: torch.Tensor | None = None
    """[batch, seq] this rank's token ids, for a model that reads them past its first pipeline
    stage (multi-token prediction); None: the model's input is the tokens."""
    setup: AttnSetup = AttnSetup()
    seq_len: int = 0
    device: torch.device | None = None
    """This rank's sequence length and device: with them, flex's block masks are built here."""
    cache: _BatchCache = field(default_factory=_BatchCache, repr=False)
    past: Cache | None = None
    """Generation: every layer's past tokens (titanlite.layers.cache); this forward's tokens
    follow them. None: the batch is the whole sequence (training)."""

    def __post_init__(self) -> None:
        if self.setup.cp is not None and self.positions is None:
            raise ValueError("AttnContext: context parallel needs the positions of the rank's tokens")
        if self.setup.backend == "flex" and self.seq_len:
            for _, start, n in _query_chunks(self, self.seq_len):
                for window in self.setup.windows or (None,):
                    _cached_block_mask(self, start, n, window, self.device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext | None = None,
              window: int | None = None, sinks: torch.Tensor | None = None,
              scale: float | None = None, layer: object = None) -> torch.Tensor:
    """q: [B, Hq, S, Dqk]; k: [B, Hkv, S, Dqk]; v: [B, Hkv, S, Dv], Hq a multiple of Hkv.
    `window`: keys a query sees, itself included (None: all before it); `sinks`: [Hq] logits
    of a key every query sees with value zero; `scale`: softmax scale (default Dqk^-0.5).
    Returns [B, Hq, S, Dv]. S is this rank's head-tail shard under context parallel.
    `layer`: the calling layer, whose keys and values `ctx.past` keeps when generating."""
    ctx = ctx or AttnContext()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if sinks is not None and isinstance(sinks, DTensor):  # under TP: this rank's heads
        sinks = sinks.to_local()
    if ctx.past is not None:
        if layer is None:
            raise ValueError("attention with a generation cache needs the calling layer (layer=self)")
        seen, index = ctx.past.extend(layer, window, dim=2, k=k, v=v)
        return masked_attention(q, seen["k"], seen["v"], ctx.past.mask(index, q.shape[2], window), sinks, scale)
    if ctx.setup.backend == "varlen":
        if sinks is not None:  # preflight refuses this before launch; callers of the API get it here
            raise ValueError("attention backend varlen cannot apply attention sinks; use sdpa or flex")
        return _varlen(q, k, v, ctx, window, scale)
    if ctx.setup.cp is not None:
        dk = k.shape[-1]  # one all-gather for both, even when Dqk != Dv
        kv = ctx.setup.cp.gather(torch.cat([k, v], dim=-1), dim=2)
        k, v = kv[..., :dk], kv[..., dk:]
    if ctx.setup.backend == "flex":
        return _flex(q, k, v, ctx, window, sinks, scale)
    if ctx.setup.cp is None and ctx.document_ids is None and window is None and sinks is None:
        return _sdpa(q, k, v, None, scale)
    outs = []
    for local, start, n in _query_chunks(ctx, q.shape[2]):
        for a in range(0, n, QUERY_BLOCK):
            b = min(n, a + QUERY_BLOCK)
            lo = 0 if window is None else max(0, start + a - window + 1)
            # recomputed in backward: a saved mask per block would add up to [S, S]
            outs.append(checkpoint(_masked_block, q[:, :, local + a:local + b], k[:, :, lo:start + b],
                                   v[:, :, lo:start + b], start + a, lo, ctx.document_ids, window, sinks, scale,
                                   use_reentrant=False))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _query_chunks(ctx: AttnContext, local_len: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each contiguous run of this rank's queries."""
    if ctx.setup.cp is None:
        return [(0, 0, local_len)]
    c = local_len // 2
    return [(j * c, chunk * c, c) for j, chunk in enumerate(ctx.setup.cp.chunks())]


def _masked_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, k0: int,
                  docs: torch.Tensor | None, window: int | None, sinks: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """Queries from global index q0 against keys from k0, with their mask built here."""
    qi = torch.arange(q0, q0 + q.shape[2], device=q.device)[:, None]
    ki = torch.arange(k0, k0 + k.shape[2], device=q.device)[None, :]
    mask = ki <= qi
    if window is not None:
        mask = mask & (qi - ki < window)
    mask = mask[None, None]
    if docs is not None:
        docs = docs.to(q.device)
        mask = mask & (docs[:, q0:q0 + q.shape[2], None] == docs[:, None, k0:k0 + k.shape[2]])[:, None]
    return masked_attention(q, k, v, mask, sinks, scale)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA of q against k, v where the boolean `mask` ([B or 1, 1, Sq, Sk]) allows; with
    `sinks`, each head's sink is one more key of value zero that every query sees."""
    if sinks is not None:
        b, h = max(q.shape[0], mask.shape[0]), q.shape[1]
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        sink = sinks.to(q.dtype).view(1, h, 1, 1).expand(b, h, q.shape[2], 1)
        mask = torch.cat([bias.expand(b, h, -1, -1), sink], dim=-1)
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
    return _sdpa(q, k, v, mask, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """SDPA; mask None means causal with queries and keys starting together."""
    if v.shape[-1] < q.shape[-1]:
        # MLA's values are narrower than its queries and keys; the flash kernels need one head
        # dim for all three and the math kernel would hold every score: zero columns of V cost
        # less (PV work grows by Dqk / Dv) and are sliced off the output
        dv = v.shape[-1]
        return _sdpa(q, k, F.pad(v, (0, q.shape[-1] - dv)), mask, scale)[..., :dv]
    rep = q.shape[1] // k.shape[1]
    # Flash kernels read shared K/V heads in place (no expanded copy, no sum over the copies
    # in backward). CUDA has flash only for 16-bit dtypes and without a mask; elsewhere it picks
    # the memory-efficient kernel, which has no GQA and would fall back to the math kernel.
    if q.device.type == "cpu" or (mask is None and q.dtype in (torch.float16, torch.bfloat16)):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=rep > 1)
    if rep > 1:
        k = k.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
        v = v.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


_compiled: dict[str, Callable] = {}


def _flex_fn(name: str, device: torch.device) -> Callable:
    """flex_attention or create_block_mask, compiled on GPU (eager, FlexAttention materialises
    the whole score matrix; compiled it is one fused kernel)."""
    from torch.nn.attention import flex_attention as flex
    fn = getattr(flex, name)
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn)
    return _compiled[name]


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, window: int | None,
          sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest
    outs = []
    for local, start, n in _query_chunks(ctx, q.shape[2]):
        mask = _cached_block_mask(ctx, start, n, window, q.device)
        out, aux = _flex_fn("flex_attention", q.device)(
            q[:, :, local:local + n], k[:, :, :start + n], v[:, :, :start + n], block_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
        if sinks is not None:
            out = out * torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
        outs.append(out)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _cached_block_mask(ctx: AttnContext, start: int, n: int, window: int | None, device: torch.device | None):
    """The block mask of queries [start, start + n) against keys [0, start + n), built once a batch."""
    return ctx.cache.get(("flex", start, n, window), lambda: _block_mask(ctx, start, n, window, device))


def _block_mask(ctx: AttnContext, start: int, n: int, window: int | None, device: torch.device | None):
    docs = None if ctx.document_ids is None else ctx.document_ids.to(device)

    def visible(b, h, q_idx, kv_idx):
        qi = q_idx + start
        ok = kv_idx <= qi
        if window is not None:
            ok = ok & (qi - kv_idx < window)
        if docs is not None:
            ok = ok & (docs[b, qi] == docs[b, kv_idx])
        return ok

    rows = None if docs is None else docs.shape[0]
    return _flex_fn("create_block_mask", device)(visible, rows, None, n, start + n, device=device)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, window: int | None,
            scale: float) -> torch.Tensor:
    """Each document of each row is a sequence of its own, packed [tokens, heads, dim]."""
    from torch.nn.attention.varlen import varlen_attn
    b, h, s, _ = q.shape
    cu, longest = ctx.cache.get(("varlen", b, s), lambda: _document_bounds(ctx, b, s, q.device))
    gqa = {"enable_gqa": h != k.shape[1]} if _VARLEN_GQA else {}
    if h != k.shape[1] and not _VARLEN_GQA:  # torch 2.11's kernel has no enable_gqa: repeat the key/value heads
        k, v = (x.repeat_interleave(h // x.shape[1], 1) for x in (k, v))
    packed = [x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3]) for x in (q, k, v)]
    out = varlen_attn(*packed, cu, cu, longest, longest, scale=scale, **gqa,
                      window_size=(-1 if window is None else window - 1, 0))
    return out.view(b, s, h, -1).transpose(1, 2)


def _varlen_takes_gqa() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


_VARLEN_GQA = _varlen_takes_gqa()
"""Whether this torch's varlen kernel shares key/value heads itself (enable_gqa, after torch 2.11)."""


def _document_bounds(ctx: AttnContext, b: int, s: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """varlen's cumulative document starts over the packed batch, and its longest document:
    one host read per batch, shared by every layer and by the recompute under AC."""
    docs = ctx.document_ids if ctx.document_ids is not None else torch.zeros(b, s, dtype=torch.long)
    docs = docs.to(device)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    bounds = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([b * s], device=device)])
    return bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max())


Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [B, S, H, D], cos, sin) -> x rotated: titanlite.layers.rope.rotate_pairs or rotate_halves."""


class Attention(nn.Module):
    """Grouped-query attention with RoPE: n_heads query heads share n_kv_heads key/value heads.
    With `qk_norm_eps`, each query and key head is RMS-normalised before RoPE (Qwen3's QK-norm:
    one weight of head_dim elements, shared by all heads). `window`: a sliding window of that
    many keys; `sinks`: a learned sink logit per query head (gpt-oss); `bias`: biases on the
    q, k, v and output projections (gpt-oss)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rotate: Rotation,
                 qk_norm_eps: float | None = None, window: int | None = None, sinks: bool = False,
                 bias: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.rotate = rotate
        self.window = window
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm = None if qk_norm_eps is None else nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx, self.window, self.sinks,
                        layer=self)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
