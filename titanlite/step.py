"""The step seam: what one optimizer step does with its micro-batches.

A step object is chosen once at setup and called once per optimizer step with this rank's
micro-batches (on the device, context-parallel sharded). It runs forward, loss and backward
and returns a `StepOutput`; `eval_loss_sum` runs forward only (validation). `PlainStep` runs
each micro-batch through the whole model in turn; a pipeline schedule is the other kind.

The loss is the sum of token losses divided by the step's global target count, so results do
not depend on the layout or the micro-batch split. Extra terms a model adds
(`titanlite.loss.ExtraLosses`, which the step owns and binds to the model's layers) are divided
by the same count and returned for logging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.layers.attention import AttnSetup
from titanlite.data.pairs import target_count
from titanlite.loss import ExtraLosses, LossFn, loss_context, token_logprobs

Batch = dict[str, torch.Tensor]


@dataclass
class StepOutput:
    loss_sum: torch.Tensor
    """This rank's summed token loss over the step's micro-batches; 0 where a rank computes no
    loss (a pipeline stage before the last). Tensor-parallel ranks hold the same value."""
    n_targets: torch.Tensor
    """The step's global target-token count, the same on every rank."""
    extra_losses: dict[str, torch.Tensor]
    """name -> this rank's sum of that extra loss term; logged like the loss (summed over the
    loss group, divided by n_targets)."""


def count_targets(batches: list[Batch], group: dist.ProcessGroup) -> torch.Tensor:
    """The global number of target tokens (of pairs, for preference labels): local (cp-sharded)
    labels summed over dp x cp."""
    n = sum(target_count(b["labels"]) for b in batches)
    dist.all_reduce(n, group=group)
    return n


@dataclass
class PlainStep:
    """Each micro-batch through the whole model: forward, loss, backward, in turn."""

    model: nn.Module
    loss_fn: LossFn
    loss_parallel: bool
    attn: AttnSetup
    """The model's attention setup (backend, windows, cp), which makes each batch's context."""
    target_group: dist.ProcessGroup
    autocast: contextlib.AbstractContextManager
    mirrors: tuple[nn.Parameter, ...] = ()
    """Parameters that copy another one held elsewhere (a pipeline stage's tied weight): the
    gradient norm counts them once, through the original."""
    across: Callable[[torch.Tensor], None] | None = None
    """Sums the target count over the replica groups of the step's quorum, in place (torchft)."""
    extra: ExtraLosses = field(default_factory=ExtraLosses)

    def __post_init__(self) -> None:
        self.extra.bind([self.model])

    def logits(self, batch: Batch) -> torch.Tensor:
        """The model's logits on a micro-batch (vocab-sharded DTensor under loss parallel)."""
        ids = batch["input_ids"]
        ctx = self.attn.context(batch.get("positions"), batch.get("document_ids"), seq_len=ids.shape[1],
                                device=ids.device)
        with self.autocast:
            return self.model(batch["input_ids"], ctx)

    def _loss_sum(self, batch: Batch, extra: ExtraLosses | None = None) -> torch.Tensor:
        return self.loss_fn(self.logits(batch), batch["labels"], extra)

    def __call__(self, batches: list[Batch]) -> StepOutput:
        n_targets = count_targets(batches, self.target_group)
        if self.across is not None:
            self.across(n_targets)
        loss_sum = torch.zeros((), device=n_targets.device)
        with self.extra.collect(n_targets) as extra:
            for batch in batches:
                # loss parallel must cover the backward too
                with loss_context(self.loss_parallel):
                    loss = self._loss_sum(batch, self.extra)
                    (loss / n_targets).backward()
                loss_sum += loss.detach()
        return StepOutput(loss_sum, n_targets, extra)

    def eval_loss_sum(self, batch: Batch) -> torch.Tensor:
        with loss_context(self.loss_parallel):
            return self._loss_sum(batch)

    def eval_logprobs(self, batch: Batch) -> torch.Tensor:
        """Each label's log-probability (titanlite.loss.token_logprobs) of a prepared batch, forward
        only: what in-loop evaluation (titanlite.eval.score) sums."""
        with loss_context(self.loss_parallel):
            return token_logprobs(self.logits(batch), batch["labels"])

    def eval_rows(self, batch: Batch, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
        """fn(logits, labels) of a prepared batch, forward only, as [rows, seq] of `dtype`: exact
        match's greedy tokens where a decode step cannot run (titanlite.eval.score.by_whole_rows)."""
        with loss_context(self.loss_parallel):
            return fn(self.logits(batch), batch["labels"]).to(dtype)
