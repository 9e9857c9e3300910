"""The training loss: summed token cross-entropy, optionally on vocab-sharded logits, and
optionally compiled, in chunks of tokens at long context; optionally with a z-loss (`ZLoss`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from titanlite.config.job import Compile

IGNORE_INDEX = -100
LossFn = Callable[..., torch.Tensor]
"""(logits, labels, extra=None) -> the summed token loss; `extra`: the step's ExtraLosses inside a
training step (where a loss adds its own terms, as the z-loss does), None outside one."""
Z_LOSS = "z_loss"
"""The z-loss's name among a step's extra losses (metrics.jsonl `z_loss`, TensorBoard loss/z)."""
CHUNK_BYTES = 1 << 28
"""The float32 logits (this rank's vocabulary shard) the loss holds for one chunk of tokens."""


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward, loss and backward: loss parallel needs its ops in both directions."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def chunked(token_loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LossFn:
    """Sum `token_loss_sum` over chunks of at most CHUNK_BYTES of float32 logits, each chunk
    recomputed in backward. Whole, the loss keeps the float32 log-softmax of every token for
    backward and its gradient at once (2 x 7.8 GiB for Llama 3's vocabulary at 16,384 tokens
    per rank); chunked, it keeps only the logits it was given and one chunk's float32 at a time.
    A `token_loss_sum` that returns a tuple of sums is summed term by term.

    Under loss parallel, the logits are a DTensor sharded on vocab; each rank reduces its
    shard and the result is the same (replicated) sum on every tensor-parallel rank."""
    def loss_sum(logits: torch.Tensor, labels: torch.Tensor, extra: ExtraLosses | None = None) -> torch.Tensor:
        # extra: unused; a plain token loss adds no term of its own
        flat, targets = logits.flatten(0, 1), labels.flatten()
        vocab = (flat.to_local() if isinstance(flat, DTensor) else flat).shape[-1]
        rows = max(1, CHUNK_BYTES // (4 * vocab))
        if rows >= len(targets):
            loss = token_loss_sum(flat, targets)
        else:
            parts = [checkpoint(token_loss_sum, x, y, use_reentrant=False)
                     for x, y in zip(flat.split(rows), targets.split(rows))]
            loss = tuple(map(sum, zip(*parts))) if isinstance(parts[0], tuple) else sum(parts)
        if isinstance(loss, tuple):
            return tuple(_plain(x) for x in loss)
        return _plain(loss)

    return loss_sum


def _plain(loss: torch.Tensor) -> torch.Tensor:
    return loss.to_local() if isinstance(loss, DTensor) else loss


cross_entropy_sum = chunked(_token_loss_sum)
"""Sum of the per-token losses over targets that are not IGNORE_INDEX, as a plain tensor."""


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) of each token in float32, 0 where the label is IGNORE_INDEX, shaped as `labels`,
    a plain tensor with its autograd graph. What evaluation, preference and RL losses sum: the
    negated per-token cross-entropy, so it equals the training loss's terms to the bit. Under loss
    parallel (vocab-sharded DTensor logits) call it inside loss_context(True); every
    tensor-parallel rank gets the same values without gathering the vocabulary.

    In chunks of tokens as the training loss (`chunked`): at most CHUNK_BYTES of float32 logits
    and log-softmax at a time, not the whole batch's (31 GiB for Llama 3's vocabulary at 8 x
    8,192 tokens); under autograd each chunk is recomputed in backward instead of kept."""
    flat, targets = logits.flatten(0, 1), labels.flatten()
    vocab = (flat.to_local() if isinstance(flat, DTensor) else flat).shape[-1]
    rows = max(1, CHUNK_BYTES // (4 * vocab))
    if rows >= len(targets):
        return _token_logprobs(flat, targets).view(labels.shape)
    keep = torch.is_grad_enabled() and flat.requires_grad
    parts = [checkpoint(_token_logprobs, x, y, use_reentrant=False) if keep else _token_logprobs(x, y)
             for x, y in zip(flat.split(rows), targets.split(rows))]
    return torch.cat(parts).view(labels.shape)


def _token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _plain(-F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=IGNORE_INDEX))


def segment_sums(values: torch.Tensor, segments: torch.Tensor, n: int) -> torch.Tensor:
    """Sums of `values` by segment: out[k] = sum of values where segments == k, for k < n;
    positions whose segment is negative count nowhere. A packed row's responses (a preference
    pair's chosen and rejected, an RL completion, an evaluation's continuation) each get their
    own segment id, so their log-probabilities are summed without touching padding or prompts.
    On a context-parallel or data-parallel shard, the sums of this rank's tokens: all-reduce
    them over the group that holds the rest."""
    # the others summed into a slot past the end and dropped: no boolean indexing, whose size
    # depends on the values (a host sync on GPU; the dry run's fake tensors cannot size it)
    out = torch.zeros(n + 1, dtype=values.dtype, device=values.device)
    return out.index_add(0, torch.where(segments >= 0, segments, n).flatten(), values.flatten())[:n]


class _LogSumExpOverShards(torch.autograd.Function):
    """logsumexp over the last dimension of vocab-sharded logits: each rank's shard, its max and
    its sum of exponentials all-reduced over `group`. Backward is softmax on this rank's shard,
    with no collective: every rank of the group holds the same (replicated) result downstream."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        peak = local.amax(-1)
        dist.all_reduce(peak, dist.ReduceOp.MAX, group=group)
        total = (local - peak[..., None]).exp().sum(-1)
        dist.all_reduce(total, group=group)
        lse = peak + total.log()
        ctx.save_for_backward(local, lse)
        return lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        local, lse = ctx.saved_tensors
        return grad[..., None] * (local - lse[..., None]).exp(), None


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the vocabulary (the last dimension), a plain tensor; of DTensor logits
    (loss parallel: sharded on vocab over one mesh dimension) without gathering them."""
    if not isinstance(x, DTensor):
        return torch.logsumexp(x, -1)
    dim = next(i for i, p in enumerate(x.placements) if p.is_shard() and p.dim % x.ndim == x.ndim - 1)
    return _LogSumExpOverShards.apply(x.to_local(), x.device_mesh.get_group(dim))


def _ce_and_lse_sq_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed token cross-entropy, and the sum of logsumexp(logits)^2 over the same targets."""
    x = logits.float()
    ce = F.cross_entropy(x, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    lse = torch.where(labels != IGNORE_INDEX, _logsumexp(x), 0.0)
    return ce, lse.square().sum()


@dataclass(frozen=True)
class ZLoss:
    """Cross-entropy plus the z-loss `weight x logsumexp(logits)^2` of each target token (PaLM;
    OLMo 2), which keeps the softmax normaliser near 1. In a training step the term joins the
    step's extra losses (`Z_LOSS`): divided by the global target count like the cross-entropy,
    its gradient added in backward, its sum returned apart for logging. The returned value is the
    cross-entropy alone, as is the loss outside a step (validation)."""

    weight: float
    terms: LossFn
    """chunked(cross-entropy and logsumexp^2 sums), compiled or not."""
    cross_entropy: LossFn

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: ExtraLosses | None = None) -> torch.Tensor:
        if extra is None or extra.scale is None or not torch.is_grad_enabled():
            return self.cross_entropy(logits, labels)
        ce, lse_sq = self.terms(logits, labels)
        return extra.add(ce, Z_LOSS, self.weight * lse_sq)


def build_loss_fn(cfg: Compile, loss_parallel: bool, z_loss: float = 0.0) -> LossFn:
    """cross_entropy_sum, each chunk compiled when compile.components has "loss". Under loss
    parallel it stays eager: its DTensor cross-entropy runs inside the loss_parallel() context.
    With `z_loss` > 0 (training.z_loss), a ZLoss of that weight; at 0 the plain loss, unchanged."""
    compiled = cfg.enable and "loss" in cfg.components and not loss_parallel
    ce = chunked(torch.compile(_token_loss_sum, fullgraph=True)) if compiled else cross_entropy_sum
    if not z_loss:
        return ce
    return ZLoss(z_loss, chunked(torch.compile(_ce_and_lse_sq_sums, fullgraph=True) if compiled
                                 else _ce_and_lse_sq_sums), ce)


def logged_terms(names: tuple[str, ...], tp_replicated: tuple[str, ...], z_loss: float, more: tuple[str, ...] = ()
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The extra loss terms a run logs (a model's `names`, those of them tensor-parallel ranks hold
    alike), with a z-loss its term and the loss's own `more` (preference metrics), which every
    tensor-parallel rank holds alike."""
    own = (Z_LOSS, *more) if z_loss else more
    return (*names, *own), (*tp_replicated, *own)


# ---- extra loss terms that a model adds (e.g. MoE load balancing) ----------------------

class _AddLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss_sum: torch.Tensor, scale: torch.Tensor, owner: "ExtraLosses",
                name: str, order: int) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.shape, ctx.dtype = loss_sum.shape, loss_sum.dtype
        ctx.owner, ctx.name, ctx.order, ctx.value = owner, name, order, loss_sum.detach()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None]:
        # Recorded here, not in forward: an activation-checkpoint recomputation runs the forward
        # again, but only the first forward's node runs backward, once
        ctx.owner.terms[ctx.order] = (ctx.name, ctx.value)
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.dtype).expand(ctx.shape), None, None, None, None


@dataclass
class ExtraLosses:
    """The extra loss terms of a training step, owned by the step object. Modules that add a term
    declare an `extra_losses` attribute (None when built); the step hands them its ExtraLosses
    with `bind`, and each step runs inside `collect`."""

    scale: torch.Tensor | None = None
    """1 / the step's global target count, the training loss's scale; None outside a step."""
    terms: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    """forward order -> (name, loss_sum) of each term whose backward has run this step."""
    forwards: int = 0

    def bind(self, parts: list[nn.Module]) -> None:
        for part in parts:
            for module in part.modules():
                if hasattr(module, "extra_losses"):
                    module.extra_losses = self

    def add(self, x: torch.Tensor, name: str, loss_sum: torch.Tensor) -> torch.Tensor:
        """Add `loss_sum / global target count` to the training loss; returns `x` unchanged.

        Model code calls this in forward on an activation that reaches the loss (its backward is
        where the term's gradient enters, so it works in any pipeline stage). `loss_sum` must be a
        sum over tokens (or sequences), never a mean: summed over micro-batches and ranks and
        divided by the global target count, the term then does not depend on the layout. Outside
        a training step (validation, plain calls) it is a no-op.
        """
        if self.scale is None or not torch.is_grad_enabled():
            return x
        self.forwards += 1
        return _AddLoss.apply(x, loss_sum, self.scale, self, name, self.forwards)

    @contextlib.contextmanager
    def collect(self, n_targets: torch.Tensor):
        """Within a training step: extra terms are scaled like the token loss; yields their
        sums by name, filled when the step's backward is done."""
        self.scale, self.terms, self.forwards = 1.0 / n_targets, {}, 0
        sums: dict[str, torch.Tensor] = {}
        try:
            yield sums
        finally:
            self.scale = None
            for order in sorted(self.terms):  # summed in forward order, as the layers ran
                name, value = self.terms[order]
                sums[name] = value if name not in sums else sums[name] + value
            self.terms = {}


def add_extra_loss(extra: ExtraLosses | None, x: torch.Tensor, name: str, loss_sum: torch.Tensor) -> torch.Tensor:
    """`extra.add(x, name, loss_sum)` for a module whose `extra_losses` no step has bound (None): x."""
    return x if extra is None else extra.add(x, name, loss_sum)
