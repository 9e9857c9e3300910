"""The training loss: summed token cross-entropy, optionally on vocab-sharded logits, and
optionally compiled."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.config.job import Compile

IGNORE_INDEX = -100


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward, loss and backward: loss parallel needs its ops in both directions."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the per-token losses over targets that are not IGNORE_INDEX, as a plain tensor.

    Under loss parallel, `logits` is a DTensor sharded on vocab; each rank reduces its
    shard and the result is the same (replicated) sum on every tensor-parallel rank.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    return loss.to_local() if isinstance(loss, DTensor) else loss


def build_loss_fn(cfg: Compile, loss_parallel: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """cross_entropy_sum, compiled when compile.components has "loss". Under loss parallel it
    stays eager: its DTensor cross-entropy runs inside the loss_parallel() context."""
    if cfg.enable and "loss" in cfg.components and not loss_parallel:
        return torch.compile(cross_entropy_sum, fullgraph=True)
    return cross_entropy_sum


# ---- extra loss terms that a model adds (e.g. MoE load balancing) ----------------------

class _ExtraLosses:
    """What the running step needs: the scale of the training loss (1 / global target count)
    and the sums of the extra terms, for logging."""

    scale: torch.Tensor | None = None
    sums: dict[str, torch.Tensor] = {}


class _AddLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss_sum: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.shape, ctx.dtype = loss_sum.shape, loss_sum.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.dtype).expand(ctx.shape), None


def add_extra_loss(x: torch.Tensor, name: str, loss_sum: torch.Tensor) -> torch.Tensor:
    """Add `loss_sum / global target count` to the training loss; returns `x` unchanged.

    Model code calls this in forward on an activation that reaches the loss (its backward is
    where the term's gradient enters, so it works in any pipeline stage). `loss_sum` must be a
    sum over tokens (or sequences), never a mean: summed over micro-batches and ranks and
    divided by the global target count, the term then does not depend on the layout. Outside
    a training step (validation, plain calls) it is a no-op.
    """
    if _ExtraLosses.scale is None or not torch.is_grad_enabled():
        return x
    if torch._C._current_graph_task_id() == -1:  # not an activation-checkpoint recomputation
        total = _ExtraLosses.sums.get(name)
        _ExtraLosses.sums[name] = loss_sum.detach() if total is None else total + loss_sum.detach()
    return _AddLoss.apply(x, loss_sum, _ExtraLosses.scale)


@contextlib.contextmanager
def extra_losses(n_targets: torch.Tensor):
    """Within a training step: extra terms are scaled like the token loss; yields their sums."""
    _ExtraLosses.scale, _ExtraLosses.sums = 1.0 / n_targets, {}
    try:
        yield _ExtraLosses.sums
    finally:
        _ExtraLosses.scale = None
