"""The loop body that train.py and the dry run share: one optimizer step, from this rank's
micro-batches to the post-step hooks.

    batches -> step (forward, loss, backward) -> global norm (+ the referee's votes)
            -> verdict -> clip -> optimizer update (unless skipped) -> post-step hooks

What a training run and the dry run do differently goes through their `Referee`: a run's judges
the step with its fault guard (whose votes ride on the norm's all-reduce, and whose verdict may
skip the update); the dry run's never skips and lets its tracer watch the gradient reduction.
The learning-rate schedule and zeroing the gradients stay with the caller (the dry run reads
the gradients after the step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlite.optim import Optimizers
from titanlite.parallel.grad_norm import clip_grads, global_norm, local_grad_sq, reduce_partial_grads
from titanlite.parallel.pipeline import PipelineStep
from titanlite.step import Batch, PlainStep, StepOutput


@dataclass(frozen=True)
class Verdict:
    bad: torch.Tensor
    """A device flag, 1.0 for a non-finite step: the post-step hooks keep their state then."""
    skip: bool
    """The host's decision to skip the optimizer update."""
    found_inf: torch.Tensor | None = None
    """What the optimizer is told (fused ones skip a non-finite update on the device), or None."""


class Referee(ABC):
    """Judges a step: its votes join the gradient norm's all-reduce, its verdict comes back.
    The gradient reduction and the local norm are the plain ones unless a referee watches them."""

    @abstractmethod
    def votes(self, out: StepOutput) -> torch.Tensor:
        """This rank's votes (a vector), summed over the world with the norm."""

    @abstractmethod
    def verdict(self, grad_norm: torch.Tensor, votes: torch.Tensor) -> Verdict:
        """The step's fate from the global norm and the summed votes."""

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        reduce_partial_grads(params)

    def local_grad_sq(self, params: list[nn.Parameter], stage_ranks: Sequence[int]) -> torch.Tensor:
        return local_grad_sq(params, stage_ranks)


@dataclass
class Update:
    """What follows a step's backward, fixed at setup."""

    params: list[nn.Parameter]
    """The parameters that train."""
    norm_params: list[nn.Parameter]
    """The parameters the norm counts: all but a pipeline stage's mirrors of a tied weight."""
    stage_ranks: Sequence[int]
    max_norm: float
    optimizers: Optimizers
    hooks: list
    """Post-step hooks, each called with the verdict's device flag; each may return scalars to
    log (device tensors, read only when logged)."""
    across: Callable[[list[nn.Parameter], list[torch.Tensor]], bool] | None = None
    """Replica groups (titanlite.runtime.replicas.Replicas.sync): sums the gradients and the
    given loss sums over the step's quorum; False when the quorum changed mid-step."""

    @classmethod
    def of(cls, parts: list[nn.Module], step: PlainStep | PipelineStep, stage_ranks: Sequence[int], max_norm: float,
           optimizers: Optimizers, hooks: list,
           across: Callable[[list[nn.Parameter], list[torch.Tensor]], bool] | None = None) -> Update:
        params = [p for part in parts for p in part.parameters() if p.requires_grad]  # frozen: no gradient
        norm_params = [p for p in params if all(p is not m for m in step.mirrors)]
        return cls(params, norm_params, stage_ranks, max_norm, optimizers, hooks, across)


@dataclass
class StepResult:
    out: StepOutput
    grad_norm: torch.Tensor
    verdict: Verdict
    scalars: dict[str, torch.Tensor]
    """What the post-step hooks returned to log."""


def one_step(step: PlainStep | PipelineStep, batches: list[Batch], update: Update,
             referee: Referee) -> StepResult | None:
    """One optimizer step of `step` on this rank's micro-batches `batches`; None, and nothing
    updated, when the replica groups' quorum changed during it (the caller retries the batch)."""
    out = step(batches)
    referee.reduce_grads(update.params)
    if update.across is not None and not update.across(update.params, [out.loss_sum, *out.extra_losses.values()]):
        return None
    grad_norm, votes = global_norm(referee.local_grad_sq(update.norm_params, update.stage_ranks), referee.votes(out))
    verdict = referee.verdict(grad_norm, votes)
    clip_grads(update.params, update.max_norm, grad_norm)
    if not verdict.skip:
        update.optimizers.step(verdict.found_inf)
    scalars = {}
    for hook in update.hooks:
        scalars |= hook(verdict.bad) or {}
    return StepResult(out, grad_norm, verdict, scalars)
