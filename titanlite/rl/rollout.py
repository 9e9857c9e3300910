"""GRPO's data source: each rollout batch, this rank's prompts' completions sampled from the current
policy (titanlite.generate on the training layout), scored, given group-relative advantages, and
cut into micro-batches for the plain step with the policy loss (titanlite.rl.step).

Layout independence: the step's prompts are fixed by the seed; each data-parallel rank generates a
contiguous share of them, every completion seeded by (seed, batch, prompt, sample), never by rank,
and each prompt's group generated as one batch of group_size rows, so the tokens do not depend on
who generates them. The rewards and completion lengths are all-gathered over the data-parallel
ranks, so every rank computes the same advantages and normalisation. A resumed run regenerates the
same completions: the weights are restored bitwise and the seeds depend on the batch alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config.rl import RL
from titanlite.errors import ConfigError
from titanlite.generate import FullLogits, context_length, generate
from titanlite.loss import IGNORE_INDEX
from titanlite.rl.loss import group_advantages, token_scale
from titanlite.rl.prompts import Prompts, batch_prompts
from titanlite.rl.rewards import Reward
from titanlite.rl.step import RLStep
from titanlite.step import Batch

SAMPLES_LOGGED = 4
"""Completions (with their rewards) written to rollouts.jsonl at each logged step."""


def sample_seed(seed: int, batch: int, prompt: int, sample: int) -> int:
    """The seed of one completion: a 32-bit hash of (seed, rollout batch, prompt index, sample)."""
    digest = hashlib.blake2b(f"{seed},{batch},{prompt},{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass
class Rollouts:
    r: RL
    prompts: Prompts
    decode: Callable[[list[int]], str]
    eos_ids: list[int]
    reward: Reward
    step: RLStep
    seed: int
    seq_len: int
    global_batch: int
    """Completions per rollout batch (training.global_batch_size)."""
    local_batch: int
    dp_rank: int
    dp: int
    dp_group: dist.ProcessGroup
    device: torch.device
    dump_folder: str
    due: Callable[[int], bool]
    """Whether a step's metrics are logged (its sample of completions is written then)."""
    batch: int = -1
    micro: list[Batch] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    updated_at: float = 0.0
    at: int = 0
    """The training step being run."""

    def __call__(self, step: int) -> list[Batch]:
        """This rank's micro-batches for training step `step` (1-based): a new rollout batch
        every rl.updates_per_batch steps, the same one in between."""
        batch = (step - 1) // self.r.updates_per_batch
        if batch != self.batch:
            start = time.perf_counter()
            self.micro, self.batch = self._roll(batch), batch
            self.metrics["rl/rollout_seconds"] = time.perf_counter() - start
        else:  # the batch's rewards are still the ones trained on; no rollout this step
            self.metrics["rl/rollout_seconds"] = 0.0
        self.updated_at, self.at = time.perf_counter(), step
        return self.micro

    def _everyone(self, running: bool) -> bool:
        flag = torch.tensor([float(running)], device=self.device)
        dist.all_reduce(flag, dist.ReduceOp.MAX)
        return bool(flag.item())

    def _generate(self, batch: int, indices: list[int]) -> list[tuple[int, list[int], str]]:
        """(prompt index, completion ids, completion text) of each of this rank's rows."""
        g, out = self.r.group_size, []
        model = FullLogits(self.step.model)
        context = context_length(self.step.model)
        for i in indices:
            with self.step.autocast:  # the training's mixed precision where FSDP does not cast (TP, one device)
                gens = generate(model, [self.prompts.ids[i]] * g, self.r.max_new_tokens, temperature=self.r.temperature,
                                seed=[sample_seed(self.seed, batch, i, s) for s in range(g)], eos_ids=self.eos_ids,
                                decode=self.decode, context=context,
                                everyone=self._everyone if dist.get_world_size() > 1 else None)
            out += [(i, gen.ids, gen.text or "") for gen in gens]
        return out

    def _score(self, rows: list[tuple[int, list[int], str]]) -> torch.Tensor:
        scores = []
        for i, _, text in rows:
            value = self.reward(self.prompts.texts[i], text, self.prompts.rows[i])
            ok = isinstance(value, numbers.Real) and math.isfinite(value)  # bools and numpy's numbers count
            scores.append(float(value) if ok else math.nan)
        return torch.tensor(scores, dtype=torch.float32)

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.dp == 1:
            return local
        out = torch.empty(self.dp * len(local), dtype=local.dtype, device=self.device)
        dist.all_gather_into_tensor(out, local.to(self.device), group=self.dp_group)
        return out.cpu()

    def _roll(self, batch: int) -> list[Batch]:
        g, n = self.r.group_size, self.global_batch
        order = batch_prompts(len(self.prompts.ids), batch, n // g, self.seed)
        share = n // g // self.dp
        mine = order[self.dp_rank * share:(self.dp_rank + 1) * share]
        rows = self._generate(batch, mine)
        lengths = torch.tensor([len(ids) for _, ids, _ in rows], dtype=torch.float32)
        rewards, all_lengths = self._gather(self._score(rows)), self._gather(lengths)
        if rewards.isnan().any():
            k = int(rewards.isnan().nonzero()[0])
            raise ConfigError(f"rl.reward {self.r.reward} returned a non-number (or not finite) for prompt "
                              f"{order[k // g]} (sample {k % g}) of step {batch * self.r.updates_per_batch + 1}; "
                              "it must return an int or float")
        adv = group_advantages(rewards, g)[self.dp_rank * len(rows):(self.dp_rank + 1) * len(rows)]
        n_tokens = int(all_lengths.sum())
        scale = token_scale(lengths, n_tokens, n, self.r.loss_norm, self.r.max_new_tokens)
        self.metrics = {"rl/reward_mean": rewards.mean().item(), "rl/reward_std": rewards.std().item(),
                        "rl/completion_len": all_lengths.mean().item()}
        mine_rewards = rewards[self.dp_rank * len(rows):(self.dp_rank + 1) * len(rows)]
        self.samples = [{"prompt": self.prompts.texts[i], "completion": text, "reward": float(r),
                         "answer": self.prompts.rows[i].get("answer")}
                        for (i, _, text), r in zip(rows[:SAMPLES_LOGGED], mine_rewards)]
        micro = [self._micro_batch(rows[k:k + self.local_batch], adv[k:k + self.local_batch],
                                   scale[k:k + self.local_batch]) for k in range(0, len(rows), self.local_batch)]
        # what the loss compares against, taken before any update of this batch
        if self.r.kl_coef:
            for b, logp in zip(micro, self.step.logprobs(micro, reference=True)):
                b["ref_logp"] = logp
        if self.r.updates_per_batch > 1:
            for b, logp in zip(micro, self.step.logprobs(micro, reference=False)):
                b["old_logp"] = logp
        return micro

    def _micro_batch(self, rows: list[tuple[int, list[int], str]], adv: torch.Tensor, scale: torch.Tensor) -> Batch:
        """Each row prompt + completion, right-padded to seq_len; labels only on the completion."""
        b, t = len(rows), self.seq_len
        ids = torch.zeros(b, t, dtype=torch.long)
        labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
        per_adv, per_scale = torch.zeros(b, t), torch.zeros(b, t)
        for k, (i, completion, _) in enumerate(rows):
            tokens = self.prompts.ids[i] + completion
            p = len(self.prompts.ids[i])
            ids[k, :len(tokens) - 1] = torch.tensor(tokens[:-1])
            labels[k, p - 1:len(tokens) - 1] = torch.tensor(completion)
            per_adv[k, p - 1:len(tokens) - 1] = adv[k]
            per_scale[k, p - 1:len(tokens) - 1] = float(scale[k])
        batch = {"input_ids": ids, "labels": labels, "advantages": per_adv, "scale": per_scale}
        return {k: v.to(self.device) for k, v in batch.items()}

    def hook(self, bad: torch.Tensor) -> dict[str, float]:
        """A post-step hook: this step's rl/ metrics (the loss's sums over the data-parallel ranks)."""
        stats = self.step.take_stats().to(self.device)
        if self.dp > 1:
            dist.all_reduce(stats, group=self.dp_group)
        kl, clipped, entropy, tokens = stats.tolist()
        if self.due(self.at) and dist.get_rank() == 0:
            with open(Path(self.dump_folder) / "rollouts.jsonl", "a") as f:
                f.writelines(json.dumps({"step": self.at, **row}) + "\n" for row in self.samples)
        tokens = max(tokens, 1.0)
        return {**self.metrics, "rl/kl": kl / tokens, "rl/clip_fraction": clipped / tokens,
                "rl/entropy": entropy / tokens, "rl/update_seconds": time.perf_counter() - self.updated_at}
