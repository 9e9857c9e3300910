"""What a training run does around each optimizer step besides the step itself: its referee
(`GuardReferee`, the fault guard's votes and verdict) and its row of metrics (`StepLog`);
`logged` says which steps log. titanlite.train builds both once and calls them every step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from titanlite.checkpoint.dcp import CheckpointManager
from titanlite.loop import Referee, StepResult, Verdict
from titanlite.metrics import MetricsLogger, Throughput, peak_memory_gib, reduce_losses
from titanlite.preflight import Plan
from titanlite.runtime.fault import Guard
from titanlite.runtime.spikes import Stragglers
from titanlite.step import StepOutput


def logged(step: int, log_freq: int, steps: int) -> bool:
    """Whether step `step`'s metrics are logged: the first, every log_freq-th and the last."""
    return step == 1 or step % log_freq == 0 or step == steps


@dataclass
class StepLog:
    """A step's row of metrics (console, metrics.jsonl, TensorBoard), on every rank (its losses
    and the straggler report are collectives); its verdict is read first, so the counts are
    this step's."""

    metrics: MetricsLogger
    throughput: Throughput
    stragglers: Stragglers | None
    guard: Guard
    plan: Plan
    device: torch.device
    once: bool
    """This rank counts the loss sum (tensor-parallel ranks hold the same)."""
    epoch_of: Callable[[int], int] | None
    """The epoch of a step's first sample."""
    data: dict[str, int]
    """What the data set counts (titanlite.data.packing.data_counts)."""
    spikes: bool
    """training.on_spike is on: the row counts spike_steps."""
    terms: tuple[tuple[str, ...], tuple[str, ...]]
    """The extra terms the row logs, and those tensor-parallel ranks hold alike (loss.logged_terms)."""

    def __call__(self, step: int, result: StepResult, lr: float) -> None:
        self.guard.phase("logging")
        verdict, out = self.guard.verdict, result.out
        verdict.flush()
        losses = reduce_losses(out.loss_sum, out.extra_losses, out.n_targets, *self.terms, self.once)
        speed, eta = self.throughput(step)
        self.metrics.log(step, {"loss": losses.pop("loss"), "grad_norm": result.grad_norm.item(), "lr": lr, **speed,
                                "peak_gib": peak_memory_gib(self.device), "skipped_steps": verdict.skipped,
                                "epoch": self.epoch_of(step) if self.epoch_of else None, **self.data,
                                **losses, **{k: float(v) for k, v in result.scalars.items()},
                                **({"spike_steps": verdict.spikes} if self.spikes else {}),
                                **({} if self.stragglers is None else self.stragglers.report(step, self.guard.own_s))},
                         eta)


@dataclass
class GuardReferee(Referee):
    """A training run's referee: the fault guard votes (stop, non-finite, with a spike window its
    loss share) and decides; the host reads the verdict a step late unless it syncs anyway."""

    guard: Guard
    ckpt: CheckpointManager
    fused: bool
    """The optimizer skips a non-finite update on the device (implementation = fused)."""
    once: bool
    """This rank counts the loss sum for the spike window (tensor-parallel ranks hold the same)."""
    log_freq: int
    steps: int

    def votes(self, out: StepOutput) -> torch.Tensor:
        share = (None if self.guard.verdict.window is None else
                 (out.loss_sum if self.once else torch.zeros_like(out.loss_sum)) / out.n_targets)
        return self.guard.votes(out.loss_sum, share)

    def verdict(self, grad_norm: torch.Tensor, votes: torch.Tensor) -> Verdict:
        step, rerun = self.guard.step, self.guard.verdict.rerun
        read_now = (logged(step, self.log_freq, self.steps) or self.ckpt.due(step) or not self.fused
                    or (rerun is not None and rerun.step == step))
        bad = self.guard.decide(grad_norm, votes, read_now=read_now)
        self.ckpt.wait_for_staging()  # an async save still copying must see the weights before the update
        # bad: the device's verdict, also where the host reads it a step late
        return Verdict(bad, self.guard.verdict.skip, bad if self.fused else None)
