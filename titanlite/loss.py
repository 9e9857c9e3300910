"""The training loss: summed token cross-entropy, optionally on vocab-sharded logits, and
optionally compiled."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.config import Compile

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
