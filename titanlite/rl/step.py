"""GRPO's step: the plain step (titanlite.step) with the policy loss in place of the token loss; the
rollouts' per-token tensors ride in each micro-batch. It sums the loss's statistics for the metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from titanlite.loss import ExtraLosses, loss_context, token_logprobs
from titanlite.rl.loss import STATS, PolicyLoss
from titanlite.step import Batch, PlainStep


@dataclass
class RLStep(PlainStep):
    policy: PolicyLoss | None = None
    reference: Callable[[], contextlib.AbstractContextManager] | None = None
    """What makes the model the KL's reference for a forward (titanlite.rl.reference_of)."""
    stats: torch.Tensor | None = field(default=None)
    """The STATS sums of this rank's micro-batches since the last `take_stats`."""

    @classmethod
    def of(cls, step: PlainStep, policy: PolicyLoss,
           reference: Callable[[], contextlib.AbstractContextManager] | None = None) -> RLStep:
        return cls(**{f.name: getattr(step, f.name) for f in fields(PlainStep)}, policy=policy, reference=reference)

    def _loss_sum(self, batch: Batch, extra: ExtraLosses | None = None) -> torch.Tensor:
        loss, stats = self.policy(self.logits(batch), batch["labels"], batch["advantages"], batch["scale"],
                                  batch.get("old_logp"), batch.get("ref_logp"))
        self.stats = stats if self.stats is None else self.stats + stats
        return loss

    def take_stats(self) -> torch.Tensor:
        out, self.stats = self.stats, None
        return torch.zeros(len(STATS)) if out is None else out

    @torch.no_grad()
    def logprobs(self, batches: list[Batch], reference: bool) -> list[torch.Tensor]:
        """Per-token log-probs of each batch's labels (of logits / temperature): the policy's now
        (old log-probs kept for rl.updates_per_batch > 1), or with `reference`, the reference's (one
        switch to it for all the batches: a frozen copy is swapped in once)."""
        with loss_context(self.loss_parallel), self.reference() if reference else contextlib.nullcontext():
            return [token_logprobs(self.logits(b) / self.policy.temperature, b["labels"]) for b in batches]

