"""The GRPO loss over a batch of rollouts: group-relative advantages, the clipped policy gradient
(PPO's ratio to the log-probs the completions were sampled with; DAPO's separate upper clip), a KL
penalty to a reference (the k3 estimator, as TRL's) and the three normalisations of the token terms.

The step divides every loss by its global target count N (titanlite.step), so each normalisation is
a per-token weight `scale` the rollouts attach, chosen so that sum(scale * term) / N is the loss:
    token    (DAPO):      1                      -> the mean over the step's completion tokens
    sequence (GRPO):      N / (n_seq * len_i)    -> the mean over completions of each one's token mean
    group    (Dr. GRPO):  N / (n_seq * max_new)  -> a constant divisor, no length bias
TRL 1.16's loss_type names them "dapo" (= "bnpo" in one process), "grpo" and "dr_grpo".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from titanlite.loss import IGNORE_INDEX, token_logprobs

ADV_EPS = 1e-4
"""Added to a group's reward standard deviation (TRL's)."""
STATS = ("kl", "clipped", "entropy", "tokens")
"""The sums a step collects for its metrics, in this order."""


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - mean) / (std + ADV_EPS) within each group of `group_size` consecutive rewards (std with
    Bessel's correction, as TRL's). A group whose rewards are all equal gets exactly 0: there is
    nothing to prefer in it, and rounding in its mean must not make a gradient."""
    r = rewards.float().view(-1, group_size)
    mean = r.mean(1, keepdim=True)
    adv = (r - mean) / (r.std(1, keepdim=True) + ADV_EPS)
    equal = (r == r[:, :1]).all(1, keepdim=True)
    return torch.where(equal, torch.zeros_like(adv), adv).view(-1)


def token_scale(lengths: torch.Tensor, n_tokens: int, n: int, loss_norm: str, max_new_tokens: int) -> torch.Tensor:
    """The per-token weight (the module doc) of each completion of `lengths` (its token counts);
    `n_tokens` and `n`: the step's completion tokens and completions over every rank."""
    if loss_norm == "token":
        return torch.ones(len(lengths))
    if loss_norm == "sequence":
        return n_tokens / (n * lengths.clamp(min=1).double())
    return torch.full((len(lengths),), n_tokens / (n * max_new_tokens), dtype=torch.float64)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each position's entropy. Vocab-sharded logits (loss parallel) stay sharded: the log-softmax is
    loss parallel's (a sharded logsumexp) and the sum over the vocabulary a reduction of [B, S]
    partial sums, not a gather of the logits."""
    logp = logits.float().log_softmax(-1)
    out = -(logp.exp() * logp).sum(-1)
    return out.full_tensor() if isinstance(out, DTensor) else out


@dataclass(frozen=True)
class PolicyLoss:
    """The summed GRPO token loss of one micro-batch; the step divides it by N."""

    clip_eps: float
    clip_eps_high: float
    kl_coef: float
    temperature: float
    """The log-probs are the sampling distribution's: logits / temperature (as TRL's)."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, scale: torch.Tensor,
                 old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed weighted loss, the STATS sums, detached). `advantages`, `scale`, `old_logp` and
        `ref_logp` are per token, aligned with `labels` (IGNORE_INDEX where no completion token);
        `old_logp` None: the completions were sampled by these weights (ratio 1, gradient kept)."""
        mask = labels != IGNORE_INDEX
        logp = token_logprobs(logits / self.temperature if self.temperature != 1 else logits, labels)
        old = logp.detach() if old_logp is None else old_logp
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps_high)
        term = -torch.min(ratio * advantages, clipped * advantages)
        kl = torch.zeros_like(logp)
        if self.kl_coef:
            delta = ref_logp - logp
            kl = torch.exp(delta) - delta - 1
            term = term + self.kl_coef * kl
        loss = (term * scale * mask).sum()
        with torch.no_grad():
            cut = (((ratio < 1 - self.clip_eps) & (advantages < 0))
                   | ((ratio > 1 + self.clip_eps_high) & (advantages > 0)))
            ent = _entropy(logits / self.temperature)
            stats = torch.stack([(kl * mask).sum(), (cut & mask).sum().float(), (ent * mask).sum(),
                                 mask.sum().float()])
        return loss, stats
