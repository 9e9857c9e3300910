"""The training loss: summed token cross-entropy, optionally on vocab-sharded logits, and
optionally compiled, in chunks of tokens at long context."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from titanlite.config.job import Compile

IGNORE_INDEX = -100
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, labels) -> the summed token loss."""
CHUNK_BYTES = 1 << 28
"""The float32 logits (this rank's vocabulary shard) the loss holds for one chunk of tokens."""


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward, loss and backward: loss parallel needs its ops in both directions."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def chunked(token_loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
            ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Sum `token_loss_sum` over chunks of at most CHUNK_BYTES of float32 logits, each chunk
    recomputed in backward. Whole, the loss keeps the float32 log-softmax of every token for
    backward and its gradient at once (2 x 7.8 GiB for Llama 3's vocabulary at 16,384 tokens
    per rank); chunked, it keeps only the logits it was given and one chunk's float32 at a time.

    Under loss parallel, the logits are a DTensor sharded on vocab; each rank reduces its
    shard and the result is the same (replicated) sum on every tensor-parallel rank."""
    def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat, targets = logits.flatten(0, 1), labels.flatten()
        vocab = (flat.to_local() if isinstance(flat, DTensor) else flat).shape[-1]
        rows = max(1, CHUNK_BYTES // (4 * vocab))
        if rows >= len(targets):
            loss = token_loss_sum(flat, targets)
        else:
            loss = sum(checkpoint(token_loss_sum, x, y, use_reentrant=False)
                       for x, y in zip(flat.split(rows), targets.split(rows)))
        return loss.to_local() if isinstance(loss, DTensor) else loss

    return loss_sum


cross_entropy_sum = chunked(_token_loss_sum)
"""Sum of the per-token losses over targets that are not IGNORE_INDEX, as a plain tensor."""


def build_loss_fn(cfg: Compile, loss_parallel: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """cross_entropy_sum, each chunk compiled when compile.components has "loss". Under loss
    parallel it stays eager: its DTensor cross-entropy runs inside the loss_parallel() context."""
    if cfg.enable and "loss" in cfg.components and not loss_parallel:
        return chunked(torch.compile(_token_loss_sum, fullgraph=True))
    return cross_entropy_sum


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
