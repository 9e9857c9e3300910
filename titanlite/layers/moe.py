"""A mixture-of-experts feed-forward layer that any model family can use (next to attention.py).

Token-choice top-k routing, dropless: every token reaches its k experts, there is no capacity
factor. Experts are SwiGLU MLPs stored as stacked weights `[num_experts, ...]` (the layout
checkpoints keep whatever the expert-parallel degree), computed with one grouped GEMM
(`torch.nn.functional.grouped_mm`) where this device supports it, else a loop over experts.

Load balancing, two kinds:
- auxiliary-loss-free (DeepSeek-V3): a per-expert bias added to the scores for *selection only*
  (the gate weights come from the unbiased scores), moved after each optimizer step towards the
  mean load by `update_router_bias`, from loads counted over the whole data-parallel batch;
- a load-balancing auxiliary loss (Switch style), added to the training loss through
  the training step's `titanlite.loss.ExtraLosses`.
Expert parallelism gives `MoE.set_dispatch` its all-to-all dispatch (titanlite/parallel/expert.py);
the math here is the single-device reference.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from titanlite.layers.feed_forward import FeedForward
from titanlite.loss import ExtraLosses, add_extra_loss

log = logging.getLogger(__name__)

AUX_LOSS = "moe_aux_loss"


@dataclass(frozen=True)
class MoEArgs:
    """One MoE layer's experts and routing. A family's ModelArgs holds it as `moe`, where the
    [moe] config keys (titanlite.model_spec.model_args) update the balancing and GEMM fields."""

    num_experts: int = 8
    top_k: int = 2
    hidden: int = 768
    """Width of each routed expert's SwiGLU hidden layer (Hugging Face's moe_intermediate_size)."""
    shared_hidden: int = 0
    """Width of the shared expert every token passes through (several shared experts are one
    wider one); 0: none."""
    shared_gate: bool = False
    """Scale the shared expert's output by sigmoid(shared_gate x), a learned per-token gate
    (Qwen3.5-MoE's shared_expert_gate, one weight row of dim elements)."""
    score_func: str = "softmax"
    """"softmax" over experts (Qwen3-MoE), per-expert "sigmoid" (DeepSeek-V3), or "topk_softmax":
    the top k logits chosen, then a softmax over those alone (gpt-oss; `renormalize` unused)."""
    renormalize: bool = True
    """Rescale each token's top-k scores to sum to one (Qwen3-MoE's norm_topk_prob)."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing: step of the selection bias after each optimizer step; 0 = off."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss; 0 = off."""
    aux_loss_per_sequence: bool = False
    """Balance each sequence's tokens (DeepSeek-V3's complementary sequence-wise loss) rather
    than the micro-batch's over all data-parallel ranks."""
    n_group: int = 1
    """Group-limited routing (DeepSeek-V3): the experts form n_group groups, each scored by the
    sum of its two best (biased) scores, and a token picks its top_k among its topk_group best
    groups; 1 = off."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' gate weights (after renormalisation)."""
    grouped_mm: str = "auto"
    """"auto": grouped GEMM where supported, else the loop; "on": grouped GEMM or an error; "off": loop."""
    router_bias: bool = False
    """A learned bias on the router's logits (gpt-oss), unlike `expert_bias`, which moves selection only."""
    expert_biases: bool = False
    """Biases on each expert's gate, up and down projections (gpt-oss)."""
    swiglu_limit: float = 0.0
    """gpt-oss's clamped SwiGLU: gate clamped above and up both ways at this limit, then
    (up + 1) * gate * sigmoid(swiglu_alpha * gate); 0: plain SwiGLU."""
    swiglu_alpha: float = 1.0
    """The sigmoid's gain in the clamped SwiGLU (1.702 in gpt-oss); used with swiglu_limit only."""


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...],
                         probe: bool = True) -> str | None:
    """None if F.grouped_mm runs for these expert widths here, else why not. `probe=False`
    checks only what needs no device, which is all CUDA needs: it runs every dtype (bf16 with
    CUTLASS on sm90 and later, others with a per-group fallback)."""
    size = torch.empty((), dtype=dtype).element_size()
    if any(d * size % 16 for d in dims):
        return f"expert widths {dims} in {dtype} are not multiples of 16 bytes (grouped GEMM strides)"
    if not probe:
        return None
    key = (device.type, dtype)
    # outside any dispatch mode: per-op activation checkpointing replays ops by count, and
    # the first forward (which probes) would not match its recomputation (which does not)
    with _disable_current_modes(), torch.no_grad():
        if key not in _PROBED:
            x = torch.zeros(4, 8, device=device, dtype=dtype)
            w = torch.zeros(2, 8, 8, device=device, dtype=dtype)
            try:
                F.grouped_mm(x, w, offs=torch.tensor([2, 4], device=device, dtype=torch.int32))
                _PROBED[key] = None
            except (RuntimeError, NotImplementedError) as e:
                _PROBED[key] = f"grouped_mm does not run on {device.type} in {dtype} ({str(e).splitlines()[0]})"
    return _PROBED[key]


_PROBED: dict[tuple[str, torch.dtype], str | None] = {}
_LOGGED: set[str] = set()


def _local(w: torch.Tensor) -> torch.Tensor:
    """The rank's experts: under expert parallelism the stacked weights are DTensors sharded on dim 0."""
    return w.to_local() if isinstance(w, DTensor) else w


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
    """silu(gate) * up; with a `limit`, gpt-oss's clamped form (MoEArgs.swiglu_limit)."""
    if not limit:
        return F.silu(gate) * up
    # gpt-oss was trained with this form: the clamps keep a large pre-activation from growing the output
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   b1: torch.Tensor | None, b2: torch.Tensor | None, b3: torch.Tensor | None, limit: float,
                   alpha: float) -> torch.Tensor:
    """Every expert's SwiGLU MLP on x's rows grouped by expert (counts[e] rows for expert e), as
    three grouped GEMMs. Plain tensors in and out and nothing read on the host, so torch.compile
    takes it whole, its row count dynamic (it follows the routing under expert parallelism)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate = F.grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = F.grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    if b1 is not None:  # each row's expert, without reading counts on the host
        rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
        gate, up = gate + b1[rows], up + b3[rows]
    out = F.grouped_mm(swiglu(gate, up, limit, alpha), w2.transpose(-2, -1), offs=offs)
    return out if b2 is None else out + b2[rows]


@functools.cache
def compiled_grouped_swiglu() -> Callable[..., torch.Tensor]:
    """grouped_swiglu compiled once for every layer, its row count dynamic (it follows the routing)."""
    return torch.compile(grouped_swiglu, fullgraph=True, dynamic=True)


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs as three stacked weights, in nn.Linear's (out, in) orientation,
    with `biases` b1, b2, b3 beside them and the SwiGLU clamped at `swiglu_limit` (MoEArgs)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, mode: str = "auto", biases: bool = False,
                 swiglu_limit: float = 0.0, swiglu_alpha: float = 1.0):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # down
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # up
        self.b1, self.b2, self.b3 = ((nn.Parameter(torch.empty(num_experts, hidden)),
                                      nn.Parameter(torch.empty(num_experts, dim)),
                                      nn.Parameter(torch.empty(num_experts, hidden))) if biases else (None,) * 3)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.mode = mode
        self.reset_parameters()
        self.use_grouped_mm: bool | None = None  # decided on the first forward, on the real device
        self.compiled = False
        """Run the grouped GEMMs compiled (per-block compile, titanlite.parallel.apply)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Give every weight and bias a value drawn from torch's global generator, as nn.Linear does
        for each expert's (out, in) slice, so a model built on a real device holds no uninitialised
        memory and is the same for one `torch.manual_seed`. On meta there is nothing to fill; the
        trainer's values come from the model's init_weights (titanlite.layers.init) either way."""
        if self.w1.is_meta:
            return
        for weight, bias in ((self.w1, self.b1), (self.w2, self.b2), (self.w3, self.b3)):
            bound = weight.shape[-1] ** -0.5  # nn.Linear's kaiming_uniform(a=sqrt(5)) and bias bound
            nn.init.uniform_(weight, -bound, bound)
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def _pick(self, x: torch.Tensor) -> bool:
        reason = "forced off by moe grouped_mm = off" if self.mode == "off" else grouped_mm_supported(
            x.device, x.dtype, tuple(self.w1.shape[1:]))
        if reason is not None and self.mode == "on":
            raise RuntimeError(f"grouped_mm = on, but {reason}")
        path = "grouped GEMM (F.grouped_mm)" if reason is None else f"a loop over experts: {reason}"
        if path not in _LOGGED:
            _LOGGED.add(path)
            log.info(f"MoE experts run as {path}")
        return reason is None

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """x: [N, dim], rows grouped by expert (counts[e] rows for the rank's local expert e, in order).
        `sizes` is counts on the host when the caller has it (the loop needs it)."""
        if self.use_grouped_mm is None:
            self.use_grouped_mm = self._pick(x)
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        b1, b2, b3 = (None if b is None else _local(b) for b in (self.b1, self.b2, self.b3))
        if torch.is_autocast_enabled(x.device.type):
            # autocast (mixed precision without FSDP) does not cover grouped_mm: without this the
            # experts would run in float32, or fail on an input autocast has already cast
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
            b1, b2, b3 = (None if b is None else b.to(dtype) for b in (b1, b2, b3))
        limit, alpha = self.swiglu_limit, self.swiglu_alpha
        if self.use_grouped_mm:
            grouped = compiled_grouped_swiglu() if self.compiled else grouped_swiglu
            return grouped(x, counts, w1, w2, w3, b1, b2, b3, limit, alpha)
        sizes = counts.tolist() if sizes is None else sizes  # the loop needs them on the host: a sync
        outs = [F.linear(swiglu(F.linear(xe, w1[e], _at(b1, e)), F.linear(xe, w3[e], _at(b3, e)), limit, alpha),
                         w2[e], _at(b2, e)) for e, xe in enumerate(torch.split(x, sizes))]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def _at(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


class Router(nn.Module):
    """Scores every expert per token and picks the top k."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)
        # Aux-loss-free balancing bias: it moves selection only, never the gate weights. A
        # buffer (not trained by the optimizer), saved in checkpoints; zero unless updated.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, dim] -> gate weights [T, k], expert ids [T, k], scores [T, E] (float32)."""
        logits = self.gate(x).float()
        scores = logits.sigmoid() if self.args.score_func == "sigmoid" else logits.softmax(-1)
        topk_softmax = self.args.score_func == "topk_softmax"
        with torch.no_grad():
            chosen = (logits if topk_softmax else scores) + self.expert_bias
            if self.args.n_group > 1:
                groups = chosen.unflatten(-1, (self.args.n_group, -1))
                best = groups.topk(2, dim=-1).values.sum(-1).topk(self.args.topk_group, dim=-1).indices
                kept = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(-1, best, True)
                chosen = groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)
            expert_ids = torch.topk(chosen, self.args.top_k, dim=-1).indices
        if topk_softmax:
            return logits.gather(-1, expert_ids).softmax(-1), expert_ids, scores
        weights = scores.gather(-1, expert_ids)
        if self.args.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.args.routed_scaling_factor != 1.0:
            weights = weights * self.args.routed_scaling_factor
        return weights, expert_ids, scores


Dispatch = Callable[[GroupedExperts, torch.Tensor, torch.Tensor], torch.Tensor]
"""(experts, x grouped by global expert id, counts per expert) -> the experts' outputs in x's order."""


def local_dispatch(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """No expert parallelism: every expert is here, x is already grouped by expert."""
    return experts(x, counts)


class MoE(nn.Module):
    """Drop-in replacement for a block's feed-forward: [B, S, dim] -> [B, S, dim]."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        if not 1 <= args.top_k <= args.num_experts:
            raise ValueError(f"MoE top_k {args.top_k} must be between 1 and num_experts {args.num_experts}")
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.hidden, args.num_experts, args.grouped_mm, args.expert_biases,
                                      args.swiglu_limit, args.swiglu_alpha)
        self.shared = FeedForward(dim, args.shared_hidden, F.silu) if args.shared_hidden else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_hidden and args.shared_gate else None
        # tokens routed to each expert since the last optimizer step, for balancing and metrics;
        # not saved (the step's counts are consumed by the post-step hook)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.dispatch: Dispatch = local_dispatch
        """Runs the experts on tokens grouped by (global) expert id (`set_dispatch`)."""
        self.stats_group: dist.ProcessGroup | None = None
        """The ranks routing different tokens of one micro-batch (data x context x tensor parallel),
        over which the auxiliary loss counts loads; None on one process."""
        self.extra_losses: ExtraLosses | None = None
        """Where the auxiliary loss goes: the training step's (bound by the step), None outside one."""

    def set_dispatch(self, dispatch: Dispatch) -> None:
        """Run the experts through `dispatch` (expert parallelism's all-to-all) instead of here."""
        self.dispatch = dispatch

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero selection biases and loads, as built; `to_empty` leaves them uninitialised."""
        self.router.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, expert_ids, scores = self.router(x)
        flat_ids = expert_ids.flatten()
        # scatter_add rather than bincount, which reads the largest id on the host (a sync) on CUDA
        counts = torch.zeros(self.args.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids))
        if self.training:  # validation (eval mode) must not steer the next bias update
            with torch.no_grad():
                # Recomputation under activation checkpointing counts a layer twice; balancing and
                # the logged max/mean only use ratios between one layer's counts, which that keeps.
                self.tokens_per_expert += counts
        # group the T*k (token, slot) pairs by expert; stable, so the order is layout independent
        order = torch.argsort(flat_ids, stable=True)
        routed = self.dispatch(self.experts, x[order // self.args.top_k], counts)
        # back to (token, slot) order, then each token's weighted sum over its k slots in slot order
        out = torch.empty_like(routed).index_copy(0, order, routed).view(-1, self.args.top_k, shape[-1])
        out = (out * weights.unsqueeze(-1).to(out.dtype)).sum(1)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        if self.args.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux = (self._sequence_aux_loss_sum(scores, expert_ids, shape) if self.args.aux_loss_per_sequence
                   else self._aux_loss_sum(scores, counts))
            out = add_extra_loss(self.extra_losses, out, AUX_LOSS, aux)
        return out.view(shape)

    def _sequence_aux_loss_sum(self, scores: torch.Tensor, expert_ids: torch.Tensor,
                               shape: torch.Size) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, coeff * sum_e f_e * P_e per sequence, f_e =
        E / (k T) x the sequence's slots routed to e, P_e its mean normalised score for e; each
        sequence's loss counted once per token, so the division by the global target count
        averages over sequences. The rank must hold whole sequences (no context or sequence
        parallel: the family's check_layout refuses those)."""
        rows, seq = shape[0], shape[1]
        e, k = self.args.num_experts, self.args.top_k
        ids = expert_ids.view(rows, seq * k)
        slots = torch.zeros(rows, e, device=scores.device).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float))
        share = (slots * e / (k * seq)).detach()
        probs = (scores / scores.sum(-1, keepdim=True)).view(rows, seq, e).mean(1)
        return self.args.aux_loss_coeff * seq * (share * probs).sum()

    def _aux_loss_sum(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """coeff * E * sum_e f_e * P_e (Switch Transformer), written as a sum over tokens so that
        dividing by the global target count gives the same loss on every layout: f_e, the share
        of routed slots that went to expert e, is counted over the micro-batch's tokens on all
        data-parallel ranks (one small all-reduce), and P_e is each token's score for e."""
        load = counts.float()
        if self.stats_group is not None:
            dist.all_reduce(load, group=self.stats_group)
        share = (load / load.sum()).detach()
        if self.args.score_func == "sigmoid":
            scores = scores / scores.sum(-1, keepdim=True)
        return self.args.aux_loss_coeff * self.args.num_experts * (scores * share).sum()


def moe_layers(parts: list[nn.Module]) -> list[MoE]:
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_router_bias(moes: list[MoE], group: dist.ProcessGroup | None, stages: dist.ProcessGroup | None = None,
                       device: torch.device | None = None, skipped: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    """After an optimizer step: sum each layer's loads over the data-parallel batch, move the
    selection bias by rate x sign(mean load - load), reset the counts. Every rank computes the
    same update from the same summed loads, so biases agree on every layout. `skipped` (a device
    flag, 1.0 when the step's update was skipped as non-finite) keeps the biases where they are,
    without the host reading it. Returns the step's load statistics over every layer (`stages`:
    the pipeline ranks holding the other layers; device tensors, no host sync) for the metrics."""
    loads = torch.stack([m.tokens_per_expert for m in moes]) if moes else torch.zeros(0, 1, device=device)
    if group is not None:
        dist.all_reduce(loads, group=group)
    mean = loads.mean(-1, keepdim=True)
    # the loads of a skipped step come from non-finite scores; x 1.0 leaves a kept step's bit for bit
    keep = 1.0 if skipped is None else 1.0 - skipped
    for m, load, avg in zip(moes, loads, mean):
        if m.args.bias_update_rate:
            m.router.expert_bias += m.args.bias_update_rate * torch.sign(avg - load) * keep
        m.tokens_per_expert.zero_()
    ratio = loads.max(-1).values / mean.squeeze(-1).clamp(min=1)
    bias_sq = sum((m.router.expert_bias.square().sum() for m in moes), loads.new_zeros(()))
    sums = torch.stack([ratio.sum(), loads.new_tensor(float(len(moes))), bias_sq])
    worst = ratio.max() if moes else loads.new_zeros(())
    if stages is not None:
        # one collective per step: every stage's [ratio sum, layers, bias norm^2, worst ratio]
        every = [torch.empty(4, device=loads.device) for _ in range(dist.get_world_size(stages))]
        dist.all_gather(every, torch.stack([*sums, worst]), group=stages)
        every = torch.stack(every)
        sums, worst = every[:, :3].sum(0), every[:, 3].max()
    return {"moe_load_max_over_mean_worst": worst, "moe_load_max_over_mean_avg": sums[0] / sums[1].clamp(min=1),
            "moe_router_bias_norm": sums[2].sqrt()}


def post_step_hooks(parts: list[nn.Module], meshes: Any
                    ) -> list[Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    """ModelSpec.post_step_hooks for any family built on this layer: after each optimizer step,
    sum the loads over the ranks routing different tokens (data x context x tensor parallel),
    move the router biases (unless the step was skipped), and hand back the load statistics over
    all pipeline stages to log."""
    moes = moe_layers(parts)
    dims = meshes.dims
    group = meshes.routed["dp_cp_tp"].get_group() if dims.dp * dims.cp * dims.tp > 1 else None
    stages = meshes.pp.get_group() if dims.pp > 1 else None
    if not moes and stages is None:
        return []
    # every stage joins the statistics, even one whose blocks are all dense
    device = next(p.device for part in parts for p in part.parameters())
    return [lambda skipped: update_router_bias(moes, group, stages, device, skipped)]
