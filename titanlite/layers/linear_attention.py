"""The linear-attention seam (`linear_attention`): the gated delta rule of Gated DeltaNet
(Qwen3.5, Qwen3-Next), and the layer built on it (`GatedDeltaNet`): projections, the causal
short convolution before the rule and the gated RMSNorm after it.

The rule, per value head, with a [d_k, d_v] state S, decay g_t <= 0 (log space) and step beta_t:
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - k_t^T exp(g_t) S_{t-1})^T,   o_t = S_t^T q_t
Computed in chunks of `chunk_size` tokens: inside a chunk the delta updates are one triangular
solve (the WY/UT form), and a scan over chunks carries S, so memory grows linearly with the
sequence ([chunk, chunk] per chunk, not [seq, seq]).

Packed documents restart the state and the convolution at each document start, as
`document_mask` keeps softmax attention inside a document: inside a chunk the decays are summed
per document and the pairs that cross a start are masked; a chunk in which a document starts
neither reads nor carries the state from before that start.

Context parallel (the batch's AttnSetup holds the cp shards): the state is passed along the cp
ranks in sequence order and the convolution gets the previous chunk's last kernel-1 tokens
(`_cp_gated_delta_rule`, `cp_causal_conv`; docs/attention.md).

Generation (AttnContext.past, titanlite.layers.cache): a layer keeps its final state and the
convolution's last kernel-1 inputs, and runs the next tokens from them with the torch rule.

Backends (`ModelArgs.linear_backend`): "torch" (this file, plain PyTorch: CPU and GPU) and
"fla", flash-linear-attention's Triton kernels (the optional extra `titanlite[fla]`; CUDA only,
never run in this repository's tests: docs/attention.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from titanlite.layers.attention import AttnContext, SequenceShards
from titanlite.layers.cache import Cache

LINEAR_BACKENDS = ("torch", "fla")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim: the form flash-linear-attention (and the released
    Qwen3.5 weights) use for q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def document_starts(ctx: AttnContext | None, seq_len: int) -> torch.Tensor | None:
    """[B, S] True where one of this rank's tokens starts a document other than its
    predecessor's (under context parallel: its head-tail share of the whole sequence's); None
    when the batch is one causal stream (no document ids)."""
    starts = _global_starts(ctx)
    if starts is None:
        return None
    if ctx.setup.cp is not None:
        return ctx.setup.cp.shard(starts, 1)
    return starts[:, :seq_len]


def _global_starts(ctx: AttnContext | None) -> torch.Tensor | None:
    """[B, full S] document starts of the whole sequence (document_ids are never sharded)."""
    if ctx is None or ctx.document_ids is None:
        return None
    docs = ctx.document_ids
    starts = torch.zeros_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return starts


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ctx: AttnContext | None = None, initial_state: torch.Tensor | None = None,
                     chunk_size: int = 64, qk_l2norm: bool = True, scale: float | None = None,
                     backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over this batch. q, k: [B, S, Hk, Dk]; v: [B, S, Hv, Dv] with Hv a
    multiple of Hk (each q/k head serves Hv / Hk consecutive value heads); g (log decay, <= 0)
    and beta: [B, S, Hv]. `qk_l2norm`: normalise q and k (in float32); `scale`: on q (default
    Dk^-0.5); `initial_state`: [B, Hv, Dk, Dv]. Returns the output [B, S, Hv, Dv] in v's dtype
    and the final state [B, Hv, Dk, Dv] in float32."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear attention backend {backend!r} is not one of {LINEAR_BACKENDS}")
    starts = document_starts(ctx, q.shape[1])
    if ctx is not None and ctx.setup.cp is not None:
        if backend != "torch" or initial_state is not None:  # preflight refuses fla under cp
            raise ValueError("linear attention under context parallel runs the torch backend from a zero state only")
        return _cp_gated_delta_rule(q, k, v, g, beta, starts, ctx.setup.cp, chunk_size, qk_l2norm, scale)
    if backend == "fla":
        return _fla(q, k, v, g, beta, starts, initial_state, qk_l2norm, scale)
    return chunk_gated_delta_rule(q, k, v, g, beta, starts, initial_state, chunk_size, qk_l2norm, scale)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           starts: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                           chunk_size: int = 64, qk_l2norm: bool = True, scale: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_attention` in plain PyTorch (float32 inside); `starts`: [B, S] document starts
    (`document_starts`), a start at position 0 dropping `initial_state`."""
    out_dtype, (b, s, hk, dk), (hv, dv) = v.dtype, k.shape, v.shape[-2:]
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    # [B, H, S, ...] in float32: the decays are exponentiated sums, which bf16 cannot hold
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    c = chunk_size
    pad = -s % c  # padded tokens have k = v = beta = g = 0: they change no state and are cut off
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (s + pad) // c
    q, k, v = (x.reshape(b, hv, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, hv, n, c), beta.reshape(b, hv, n, c)

    cum = g.cumsum(-1)  # log decay from the chunk's start to each token, itself included
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    from_start, to_end = cum, cum[..., -1:] - cum  # log decay: chunk start -> token, token -> chunk end
    if starts is None:
        pairs = causal
    else:
        starts = F.pad(starts.to(q.device), (0, pad)).reshape(b, 1, n, c)
        # the chunk position where each token's document (within this chunk) begins
        seg = torch.where(starts, torch.arange(c, device=q.device), 0).cummax(-1).values
        cum = cum - (cum - g).gather(-1, seg.expand(b, hv, n, c))  # summed within the document only
        pairs = causal & (seg[..., :, None] == seg[..., None, :])
        # a token reads the carried state only if its document continues the previous chunk's,
        # and writes the next chunk's only if it is in the chunk's last document: -inf in log
        # space, before exp (a masked product could meet exp overflowing across documents)
        carried = (seg == 0) & ~starts[..., :1]
        from_start = cum.masked_fill(~carried, float("-inf"))
        to_end = (cum[..., -1:] - cum).masked_fill(seg != seg[..., -1:], float("-inf"))
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~pairs, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly lower(T)) solves the delta updates inside a chunk: u are the corrected values
    # from the chunk alone, w the (decayed) keys through which the carried state corrects them
    t = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(t, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(t, k_beta * from_start.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_read = q * from_start.exp()[..., None]  # reads of the carried state
    k_write = k * to_end.exp()[..., None]  # writes into the next chunk's state
    keep = from_start[..., -1].exp()[..., None, None]  # the carried state's share of the next one

    state = (torch.zeros(b, hv, dk, dv, device=q.device) if initial_state is None
             else initial_state.to(device=q.device, dtype=torch.float32))
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_read[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * keep[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, hv, n * c, dv)[:, :, :s]
    return out.transpose(1, 2).to(out_dtype), state


def _cp_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         starts: torch.Tensor | None, cp: SequenceShards, chunk_size: int, qk_l2norm: bool,
                         scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over this rank's head-tail share ([B, 2L, ...]: sequence chunks h and t of 2N)
    under context parallel. A chunk's final state is affine in the state it starts from,
    S_out = M S_in + B (M: [Dk, Dk] per head, zero past a document start in the chunk), so:
    one run of both local chunks from the state [0 | I] on the values [v | 0] gives [B | M];
    one all-gather gives every chunk's (M, B) in sequence order; the prefix S_0 = 0,
    S_{c+1} = M_c S_c + B_c gives the state each local chunk starts from; a second run from it
    gives the outputs (exact: the same rule, only its start differs). Backward: the gather's
    reduce-scatter returns each rank's (M, B) gradients from every later chunk's rank."""
    def pair(x: torch.Tensor) -> torch.Tensor:  # the two local chunks as two batch rows
        return torch.cat(x.chunk(2, dim=1), dim=0)

    b, hv, dk, dv = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    q, k, v, g, beta = (pair(x) for x in (q, k, v, g, beta))
    starts = None if starts is None else pair(starts)
    identity = torch.eye(dk, device=q.device).expand(2 * b, hv, dk, dk)
    probe = torch.cat([torch.zeros(2 * b, hv, dk, dv, device=q.device), identity], dim=-1)
    _, ends = chunk_gated_delta_rule(q, k, torch.cat([v, v.new_zeros(*v.shape[:3], dk)], dim=-1), g, beta,
                                     starts, probe, chunk_size, qk_l2norm, scale)
    every = cp.gather_chunks(ends.unflatten(0, (2, b)))  # [2N, B, H, Dk, Dv + Dk]: (B | M) per chunk
    state, before = torch.zeros(b, hv, dk, dv, device=q.device), []
    for c in range(every.shape[0]):
        before.append(state)
        state = every[c, ..., dv:] @ state + every[c, ..., :dv]
    head, tail = cp.chunks()
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, starts, torch.cat([before[head], before[tail]]),
                                    chunk_size, qk_l2norm, scale)
    return torch.cat(out.chunk(2, dim=0), dim=1), state


def cp_causal_conv(xs: list[torch.Tensor], weights: list[torch.Tensor], ctx: AttnContext) -> list[torch.Tensor]:
    """`causal_conv` of each x ([B, 2L, C_i], this rank's head-tail share) under context
    parallel: every chunk's last kernel-1 tokens (all xs' channels in one all-gather) are the
    halo of the chunk after it (zeros before chunk 0); taps across a document start read zero,
    as in one process."""
    cp, kernel = ctx.setup.cp, weights[0].shape[1]
    x, weight = torch.cat(xs, dim=-1), torch.cat(weights, dim=0)
    length = x.shape[1] // 2
    if length < kernel - 1:
        raise ValueError(f"context parallel: a rank's sequence chunk of {length} tokens is shorter than the "
                         f"convolution's {kernel - 1}-token halo; lower parallelism.context_parallel_degree")
    pieces = x.unflatten(1, (2, length)).transpose(0, 1)  # [2, B, L, C]: head chunk, tail chunk
    tails = cp.gather_chunks(pieces[:, :, length - (kernel - 1):])
    halos = torch.cat([torch.zeros_like(tails[:1]), tails[:-1]])  # chunk c's halo: chunk c-1's tail
    starts = _global_starts(ctx)
    if starts is not None:  # window of chunk c: global tokens [c L - (kernel-1), (c+1) L)
        starts = F.pad(starts, (kernel - 1, 0))
    out = []
    for i, c in enumerate(cp.chunks()):
        window = torch.cat([halos[c], pieces[i]], dim=1)
        mine = None if starts is None else starts[:, c * length:(c + 1) * length + kernel - 1]
        out.append(causal_conv(window, weight, mine)[:, kernel - 1:])
    return list(torch.cat(out, dim=1).split([x.shape[-1] for x in xs], dim=-1))


def flops_per_token(k_head_dim: int, v_head_dim: int, chunk_size: int) -> int:
    """Training FLOPs (forward + backward) of `chunk_gated_delta_rule` per token and value head,
    matmuls only (FlopCounterMode's count; triangular solves and elementwise work aside). Forward,
    per token: the chunk's [C, C] products k_beta k^T and q k^T (2 x 2 C Dk), the intra-chunk
    output (2 C Dv) and three products with the [Dk, Dv] state (3 x 2 Dk Dv); backward twice that,
    plus the gradient of each triangular solve's matrix (2 C (Dk + Dv)). Linear in the sequence:
    C is the chunk size, not the context."""
    c, dk, dv = chunk_size, k_head_dim, v_head_dim
    forward = 4 * c * dk + 2 * c * dv + 6 * dk * dv
    return 3 * forward + 2 * c * (dk + dv)


def _fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         starts: torch.Tensor | None, initial_state: torch.Tensor | None, qk_l2norm: bool,
         scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-linear-attention's chunked kernel; packed documents become its variable-length
    batch (one host read of the document bounds per call). Never run here (no CUDA)."""
    fla = require_fla()
    b, s, hk, _ = q.shape
    hv = v.shape[2]
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    cu_seqlens = None
    if starts is not None:
        if initial_state is not None:
            raise ValueError("linear attention backend fla: an initial state with packed documents is not supported")
        flat = starts.clone()
        flat[:, 0] = True
        cu_seqlens = torch.cat([flat.flatten().nonzero().flatten(), torch.tensor([b * s], device=flat.device)])
        q, k, v, g, beta = (x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out, state = fla.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=True, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm_in_kernel=qk_l2norm)
    return out.reshape(b, s, hv, -1), state


def require_fla():
    """flash-linear-attention's ops module, or one line saying how to get it."""
    try:
        import fla.ops.gated_delta_rule as ops
    except ImportError:
        raise ImportError("linear_backend fla needs flash-linear-attention (pip install 'titanlite[fla]' on a CUDA "
                          "machine); or set linear_backend = \"torch\"") from None
    return ops


def causal_conv(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over the sequence. x: [B, S, C]; weight: [C, K], its last
    tap on the token itself: out[t] = sum_j weight[:, K-1-j] * x[t-j], taps before the start of
    t's document (or of the sequence) reading zero."""
    kernel = weight.shape[1]
    s = x.shape[1]
    padded = F.pad(x, (0, 0, kernel - 1, 0))
    doc = None if starts is None else F.pad(starts.to(x.device).long().cumsum(1), (kernel - 1, 0))
    out = x * weight[:, -1]
    for j in range(1, kernel):
        tap = padded[:, kernel - 1 - j:kernel - 1 - j + s] * weight[:, kernel - 1 - j]
        if doc is not None:  # a tap j tokens back counts only inside the token's document
            tap = tap * (doc[:, kernel - 1 - j:kernel - 1 - j + s] == doc[:, kernel - 1:])[..., None]
        out = out + tap
    return out


class GatedRMSNorm(nn.Module):
    """RMS-normalise x, scale by the weight, then gate by silu(gate): the norm after the delta
    rule (flash-linear-attention's FusedRMSNormGated), one weight of head_dim elements shared
    by every head. Normalised in float32, like the reference."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if isinstance(weight, DTensor):  # tensor parallel: whole here, applied to this rank's heads
            weight = weight.to_local(grad_placements=[Partial()])
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((weight * normed.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    """Under tensor parallelism: this rank's heads (or channels) of a weight used outside a Linear."""
    return t.to_local() if isinstance(t, DTensor) else t


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Qwen3.5's linear_attention layers). q, k, v come from their own
    projections (so tensor parallelism splits each by heads), each through its own causal
    convolution (`conv_q`, `conv_k`, `conv_v`: [channels, kernel]) and SiLU; beta =
    sigmoid(wb x), g = -exp(A_log) softplus(wa x + dt_bias); the rule's output is
    `norm(out, wz x)` per value head, then `wo`. The call signature is `Attention`'s, so a block
    holds either; RoPE's tables are unused (the recurrence orders the tokens)."""

    def __init__(self, dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int = 4, norm_eps: float = 1e-6, chunk_size: int = 64, backend: str = "torch"):
        super().__init__()
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.chunk_size, self.backend = chunk_size, backend
        self.wq = nn.Linear(dim, n_k_heads * k_head_dim, bias=False)
        self.wk = nn.Linear(dim, n_k_heads * k_head_dim, bias=False)
        self.wv = nn.Linear(dim, n_v_heads * v_head_dim, bias=False)
        self.wz = nn.Linear(dim, n_v_heads * v_head_dim, bias=False)
        self.wb = nn.Linear(dim, n_v_heads, bias=False)
        self.wa = nn.Linear(dim, n_v_heads, bias=False)
        self.conv_q = nn.Parameter(torch.empty(n_k_heads * k_head_dim, conv_kernel))
        self.conv_k = nn.Parameter(torch.empty(n_k_heads * k_head_dim, conv_kernel))
        self.conv_v = nn.Parameter(torch.empty(n_v_heads * v_head_dim, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(n_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, eps=norm_eps)
        self.wo = nn.Linear(n_v_heads * v_head_dim, dim, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Give the convolutions values from torch's global generator, as a depthwise nn.Conv1d
        does (uniform within 1/sqrt(kernel)), so a model built on a real device holds no
        uninitialised memory; the trainer's values come from the model's init_weights either way."""
        for w in (self.conv_q, self.conv_k, self.conv_v):
            if not w.is_meta:
                bound = w.shape[-1] ** -0.5
                nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                ctx: AttnContext | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xs = [self.wq(x), self.wk(x), self.wv(x)]
        weights = [_local(w) for w in (self.conv_q, self.conv_k, self.conv_v)]
        past = None if ctx is None else ctx.past
        if past is not None:
            xs, starts = self._conv_after_past(xs, weights, past)
        elif ctx is not None and ctx.setup.cp is not None:
            xs = cp_causal_conv(xs, weights, ctx)
        else:
            starts = document_starts(ctx, seqlen)
            xs = [causal_conv(x_, w, starts) for x_, w in zip(xs, weights)]
        # -1 heads: under tensor parallelism each rank holds only its share of heads
        q, k, v = (F.silu(x_).view(bsz, seqlen, -1, d) for x_, d in zip(xs, (self.k_head_dim, self.k_head_dim,
                                                                               self.v_head_dim)))
        beta = torch.sigmoid(self.wb(x))
        # float32: exp(A_log) of a 16-bit weight can overflow
        g = -_local(self.A_log).float().exp() * F.softplus(self.wa(x).float() + _local(self.dt_bias))
        if past is None:
            out, _ = linear_attention(q, k, v, g, beta, ctx, chunk_size=self.chunk_size, backend=self.backend)
        else:  # generation: from the state the past left (plain PyTorch; one token is one chunk)
            kept = past.state(self)
            out, kept["recurrent"] = chunk_gated_delta_rule(q, k, v, g, beta, starts, kept.get("recurrent"),
                                                            min(self.chunk_size, seqlen))
        out = self.norm(out, self.wz(x).view(bsz, seqlen, -1, self.v_head_dim))
        return self.wo(out.reshape(bsz, seqlen, -1))

    def _conv_after_past(self, xs: list[torch.Tensor], weights: list[torch.Tensor], past: Cache
                         ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Generation: `causal_conv` of this forward's inputs after the kernel-1 inputs before
        them (kept in the cache; zeros at first), and the rows' document starts among these
        tokens (a row's real tokens start after its pads: taps and state do not cross it)."""
        kept, kernel = past.state(self), weights[0].shape[1]
        x = torch.cat(xs, dim=-1)
        before = kept.get("conv")
        if before is None:
            before = x.new_zeros(x.shape[0], kernel - 1, x.shape[2])
        window = torch.cat([before, x], dim=1)
        starts = past.starts(past.length - (kernel - 1), window.shape[1])
        out = causal_conv(window, torch.cat(weights, dim=0), starts)[:, kernel - 1:]
        kept["conv"] = window[:, window.shape[1] - (kernel - 1):]
        return list(out.split([x_.shape[-1] for x_ in xs], dim=-1)), starts[:, kernel - 1:]
