"""Preference optimization (data.format preference, [preference]): the DPO family as a loss over
the same model outputs as SFT's, and the reference model's pass that comes before it.

A pair's sequence log-probability is the sum of titanlite.loss.token_logprobs over its response's
target tokens (segment_sums by the RESPONSE channel of the labels, titanlite.data.pairs), all-reduced
over the context-parallel ranks that hold the rest of the sequence. The step divides the loss sum by
the step's global pair count (the PAIR channel), as it divides a token loss by the target count, so
the loss does not depend on the layout or the micro-batch split.

The reference's per-token log-probs are computed by the step itself, before the policy's forward:
the same step's forward-only path (every layout's, pipeline included), in eval mode under no_grad,
with the LoRA adapters off (preference.reference = lora) or with the starting weights swapped in
(model), written into the labels' REFERENCE channel, which the loss sums like the policy's. With
preference.reference = precomputed, each pair's two reference sums are computed once before the
first step (Precomputed) and the samples carry them in that channel, one at each response's first
target. The SFT term (sft_weight) gets its weight from the step too, in the SFT channel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titanlite.config.data import Preference
from titanlite.config.job import JobConfig
from titanlite.errors import ConfigError
from titanlite.data.pairs import LABEL_CHANNELS, PAIR, REFERENCE, RESPONSE, SFT, TOKEN, PairSamples
from titanlite.layers.lora import adapters_off
from titanlite.loss import IGNORE_INDEX, ExtraLosses, LossFn, build_loss_fn, segment_sums, token_logprobs

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""TRL's names for the per-pair means a preference run logs (metrics.jsonl; TensorBoard train/...)."""


def _floats(channel: torch.Tensor) -> torch.Tensor:
    """A label channel that holds float32 bits (REFERENCE, SFT), as floats."""
    return channel.to(torch.int32).view(torch.float32)


def pair_sums(lp: torch.Tensor, labels: torch.Tensor, cp: int, cp_group: dist.ProcessGroup | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(policy log-prob sums, reference log-prob sums, target counts) of each pair slot of a
    micro-batch from its per-token log-probs `lp`, each [slots, 2] (chosen, rejected), in row order
    then pair order; the policy's with its graph. A slot holds a pair where its chosen count is > 0
    (every response has a target)."""
    response = labels[..., RESPONSE]
    ref = _floats(labels[..., REFERENCE])
    rows, local = response.shape
    per_row = local * cp + local * cp % 2  # a row holds fewer responses than positions
    segments = torch.where(response >= 0, response + per_row * torch.arange(rows, device=lp.device)[:, None], -1)
    n = rows * per_row
    policy = segment_sums(lp, segments, n)
    counts = segment_sums(torch.ones_like(ref), segments, n)
    refs = segment_sums(ref, segments, n)
    if cp_group is not None:  # the rest of each response is on the other context-parallel ranks
        policy = dist_fn.all_reduce(policy, group=cp_group)
        dist.all_reduce(counts, group=cp_group)
        dist.all_reduce(refs, group=cp_group)
    return policy.view(-1, 2), refs.view(-1, 2), counts.view(-1, 2)


def pair_logps(logits: torch.Tensor, labels: torch.Tensor, cp: int, cp_group: dist.ProcessGroup | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pair_sums of the logits' log-probs of the labels."""
    return pair_sums(token_logprobs(logits, labels[..., TOKEN]), labels, cp, cp_group)


def pair_losses(p: Preference, policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each pair slot's loss and TRL's metrics of it (0 where the slot holds no pair), as TRL 1.16
    computes them: DPOTrainer's sigmoid, ipo and sigmoid_norm (dpo_norm) and CPOTrainer's simpo."""
    keep = (counts[:, 0] > 0).to(policy.dtype)
    counts = counts.clamp(min=1)  # an empty slot's: its terms are 0 x a finite value
    if p.loss == "simpo":
        mean = policy / counts
        losses = -F.logsigmoid(p.beta * (mean[:, 0] - mean[:, 1]) - p.gamma)
        rewards = p.beta * mean.detach()
    else:
        ratios = policy - ref
        if p.loss == "dpo":
            losses = -F.logsigmoid(p.beta * (ratios[:, 0] - ratios[:, 1]))
        else:
            per_token = ratios / counts
            delta = per_token[:, 0] - per_token[:, 1]
            losses = (delta - 1 / (2 * p.beta)) ** 2 if p.loss == "ipo" else -F.logsigmoid(p.beta * delta)
        rewards = p.beta * ratios.detach()
    logps = policy.detach()
    metrics = {"rewards/chosen": rewards[:, 0], "rewards/rejected": rewards[:, 1],
               "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).to(policy.dtype),
               "rewards/margins": rewards[:, 0] - rewards[:, 1], "logps/chosen": logps[:, 0],
               "logps/rejected": logps[:, 1], "pairs": torch.ones_like(keep)}
    return losses * keep, {k: v * keep for k, v in metrics.items()}


@dataclass(frozen=True)
class PreferenceLoss:
    """A LossFn over preference labels: the sum of the micro-batch's pair losses (the step divides by
    the global pair count). Context-parallel ranks each return 1/cp of it: their sums are all-reduced
    with their graph, so each rank's gradient is the whole loss's. With sft_weight, the SFT term:
    each chosen target's negative log-prob times the SFT channel (the step's pairs over its chosen
    targets), so that over the step's pair count it is TRL's mean over all chosen targets; a
    context-parallel rank's over its own tokens. In a training step, each metric's sum joins the
    step's extra terms (logged per pair); outside one (validation), to `sums`."""

    p: Preference
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Outside a training step (validation): each metric's sum and the pair count, until `held_out`."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: ExtraLosses | None = None) -> torch.Tensor:
        lp = token_logprobs(logits, labels[..., TOKEN])
        losses, metrics = pair_losses(self.p, *pair_sums(lp, labels, self.cp, self.cp_group))
        total = losses.sum() / self.cp
        if self.p.sft_weight:  # TRL's sft loss type: each chosen target's NLL x pairs / chosen targets (SFT)
            total = total - self.p.sft_weight * (lp * _floats(labels[..., SFT])).sum()
        held_out = extra is None and not torch.is_grad_enabled()
        for name, values in metrics.items():
            value = values.sum() / self.cp
            if held_out:
                self.sums[name] = self.sums.get(name, 0) + value
            elif extra is not None and name in METRICS:
                total = extra.add(total, name, value)
        return total


def held_out(loss_fn: LossFn, once: bool, device: torch.device) -> dict[str, float]:
    """After a validation pass of a preference run: the held-out pairs' means of TRL's metrics, named
    val_rewards/accuracies etc. (the sums reduced over every rank, a tensor-parallel group's counted
    on its first rank, `once`), and the sums cleared; {} for any other loss."""
    if not isinstance(loss_fn, PreferenceLoss):
        return {}
    names = (*METRICS, "pairs")  # none on a pipeline stage before the last, which reduces with the rest
    sums = torch.stack([torch.as_tensor(loss_fn.sums.get(n, 0), dtype=torch.float64, device=device)
                        for n in names]) * float(once)
    dist.all_reduce(sums)
    loss_fn.sums.clear()
    return {f"val_{n}": v for n, v in zip(METRICS, (sums[:-1] / sums[-1]).tolist())}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FrozenCopy:
    """preference.reference = model: the starting weights, a copy of each parameter as the policy holds
    it (sharded alike), taken at the first reference pass (after any initial load) and saved with each
    checkpoint, so a resumed run's reference is the same. The reference pass swaps it in and out."""

    resumed_only_from_itself = True
    """A resumed checkpoint must hold it (CheckpointManager.load refuses one that does not): taken
    from the resumed weights instead, the reference would silently be another model."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.fsdp = [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]
        self.params = {f"{i}.{n}": p for i, part in enumerate(parts) for n, p in part.named_parameters()}
        self.copy = {n: p.detach().clone() for n, p in self.params.items()}
        self.taken = False

    def __len__(self) -> int:  # saved with every checkpoint (CheckpointManager.optional)
        return 1

    def state_dict(self) -> dict[str, Any]:
        self._take()
        return dict(self.copy)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, t in self.copy.items():
                _local(t).copy_(_local(sd[n]))
        self.taken = True

    def _take(self) -> None:
        if not self.taken:
            with torch.no_grad():
                for n, p in self.params.items():
                    _local(self.copy[n]).copy_(_local(p))
            self.taken = True

    def _reshard(self) -> None:
        for module in self.fsdp:
            module.reshard()

    @contextlib.contextmanager
    def swapped_in(self):
        self._take()
        with torch.no_grad():
            policy = {n: _local(p).clone() for n, p in self.params.items()}
            # FSDP keeps some modules (the root, the last block) gathered after a forward: a forward
            # would use the weights gathered before the swap, not the shards swapped in
            self._reshard()
            for n, p in self.params.items():
                _local(p).copy_(_local(self.copy[n]))
            try:
                yield
            finally:
                self._reshard()
                for n, p in self.params.items():
                    _local(p).copy_(policy[n])


def reference_of(p: Preference, fmt: str, parts: list[nn.Module], optional: dict[str, Any],
                 datasets: list[Any] = ()) -> Callable[[], contextlib.AbstractContextManager] | None:
    """What turns the policy into the reference for a forward, or None (no preference data; simpo needs
    none; precomputed sums, which the samples carry). A frozen copy (reference = model) or the
    precomputed sums of `datasets`' pairs is registered in `optional` to be checkpointed."""
    if fmt != "preference" or p.loss == "simpo":
        return None
    if p.reference == "precomputed":
        optional["reference"] = Precomputed([d for d in datasets if isinstance(d, PairSamples)])
        return None
    if p.reference == "model":
        optional["reference"] = copy = FrozenCopy(parts)
        return copy.swapped_in
    return lambda: _all_off(parts)


@contextlib.contextmanager
def _all_off(parts: list[nn.Module]):
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(adapters_off(part))
        yield


def _reference_logprobs(logits: torch.Tensor, labels: torch.Tensor, extra: ExtraLosses | None = None) -> torch.Tensor:
    return token_logprobs(logits, labels[..., TOKEN])


@torch.no_grad()
def forward_logprobs(step: Any, parts: list[nn.Module], batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each batch's per-token log-probs of its labels through the step's forward-only path (every
    layout's, pipeline included), in eval mode (no dropout, LoRA's included) under no_grad; a
    pipeline stage before the last gets a 0-dim 0 for each."""
    loss_fn, modes = step.loss_fn, [part.training for part in parts]
    step.loss_fn = _reference_logprobs
    for part in parts:
        part.eval()
    try:
        return [step.eval_loss_sum(batch) for batch in batches]
    finally:
        step.loss_fn = loss_fn
        for part, mode in zip(parts, modes):
            part.train(mode)


class Precomputed:
    """preference.reference = precomputed: the reference's log-prob sums of every pair (chosen,
    rejected) of the training and held-out samples, [pairs, 2] float32 and no weights, computed in
    one forward-only pass of the starting model before the first step (after any initial load) and
    saved with every checkpoint beside the data cursor, so a resumed run reads them back rather than
    computing them from weights that have moved on. The samples write them into their labels."""

    resumed_only_from_itself = True
    """A resumed checkpoint must hold them (CheckpointManager.load refuses one that does not)."""

    def __init__(self, datasets: list[PairSamples]) -> None:
        self.datasets = datasets
        self.logps = torch.zeros(sum(len(d.pairs) for d in datasets), 2)
        self.taken = False
        # which pairs the rows are (each response's token count and id sum): a resume whose data
        # holds other pairs, or the same in another order, would read another pair's sums
        self.pairs = torch.tensor([[len(ids), int(torch.as_tensor(ids).sum())] for d in datasets for ids, _ in d.chats],
                                  dtype=torch.int64).view(-1, 4)
        start = 0
        for d in datasets:
            d.reference = self.logps[start:start + len(d.pairs)]
            start += len(d.pairs)

    def __len__(self) -> int:  # saved with every checkpoint (CheckpointManager.optional)
        return 1

    def state_dict(self) -> dict[str, Any]:
        return {"logps": self.logps, "pairs": self.pairs.clone()}  # a copy: the load fills it to compare

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if not torch.equal(sd["pairs"], self.pairs):
            raise ConfigError("preference.reference = precomputed: the checkpoint's reference sums are of other pairs "
                              "than this run's (data.path's rows, data.holdout_fraction or the pairs training.seq_len "
                              "drops changed); resume with the data it was saved with, or start from its weights with "
                              "checkpoint.initial_load_path")
        self.logps.copy_(sd["logps"])
        self.taken = True

    def compute(self, step: Any, parts: list[nn.Module], prepare: Callable[[dict], dict], local_batch_size: int,
                dp_rank: int, dp: int, once: bool, device: torch.device) -> None:
        """The pass, unless a resume read the sums: each data-parallel rank's share of the samples in
        micro-batches of the training's shape (the last padded with rows that hold no target), the
        sums of each response's log-probs by its pair, added up over every rank (a tensor-parallel
        group's counted on its first rank, `once`; a pipeline's on its last stage)."""
        if self.taken:
            return
        step, found = getattr(step, "inner", step), []
        for d in self.datasets:
            per_row = d.seq_len + d.seq_len % 2  # a row holds fewer responses than positions
            blank = d[0]
            labels = blank["labels"]
            labels[..., TOKEN], labels[..., RESPONSE], labels[..., PAIR] = IGNORE_INDEX, -1, 0
            batches = -(-d.num_samples // (dp * local_batch_size))  # every rank the same count of forwards
            for first in range(dp_rank * local_batch_size, batches * dp * local_batch_size, dp * local_batch_size):
                gs = range(first, min(first + local_batch_size, d.num_samples))
                rows = [d[g] for g in gs] + [blank] * (local_batch_size - len(gs))
                batch = prepare({k: torch.stack([r[k] for r in rows]) for k in rows[0]})
                lp = forward_logprobs(step, parts, [batch])[0]
                if lp.ndim == 2 and once:
                    response = batch["labels"][..., RESPONSE]
                    segments = torch.where(response >= 0, response + per_row * torch.arange(len(rows),
                                           device=lp.device)[:, None], -1)
                    sums = segment_sums(lp, segments, len(rows) * per_row).view(len(rows), -1, 2).cpu()
                    found += [(d.reference, d.pair_ids(g), sums[i]) for i, g in enumerate(gs)]
        for table, ids, sums in found:
            table[ids] += sums[:len(ids)]
        total = self.logps.to(device)
        dist.all_reduce(total)
        self.logps.copy_(total.cpu())
        self.taken = True


class PreferenceStep:
    """A step (PlainStep or the pipeline's) whose micro-batches get their label channels the step
    fills first, in training and in validation: the reference's per-token log-probs (REFERENCE) and
    the SFT term's weight (SFT); everything else is the inner step's."""

    def __init__(self, inner: Any, parts: list[nn.Module],
                 reference: Callable[[], contextlib.AbstractContextManager] | None, sft: bool,
                 group: dist.ProcessGroup) -> None:
        self.inner, self.parts, self.reference, self.sft, self.group = inner, parts, reference, sft, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _fill(self, batches: list[dict[str, torch.Tensor]], training: bool) -> None:
        if self.sft:  # a training step's counts are the quorum's with fault tolerance, as its pair count is
            across = getattr(self.inner, "across", None) if training else None
            fill_sft([b["labels"] for b in batches], self.group, across)
        if self.reference is None:
            return
        # one switch to the reference for all the step's micro-batches (a frozen copy is swapped in once)
        with self.reference():
            logprobs = forward_logprobs(self.inner, self.parts, batches)
        for batch, lp in zip(batches, logprobs):
            if lp.ndim == 2:  # a pipeline stage before the last computes no loss: its labels go unread
                batch["labels"][..., REFERENCE] = lp.view(torch.int32).to(torch.int64)

    def __call__(self, batches: list[dict[str, torch.Tensor]]):
        self._fill(batches, True)
        return self.inner(batches)

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self._fill([batch], False)
        return self.inner.eval_loss_sum(batch)


def fill_sft(labels: list[torch.Tensor], group: dist.ProcessGroup | None,
             across: Callable[[torch.Tensor], None] | None = None) -> None:
    """The SFT channel of a step's labels (every micro-batch's, this rank's shard of them): the
    step's global pair count over its global chosen target count, at each chosen target."""
    chosen = [(x[..., RESPONSE] >= 0) & (x[..., RESPONSE] % 2 == 0) for x in labels]
    counts = torch.stack([sum(x[..., PAIR].sum() for x in labels), sum(c.sum() for c in chosen)]).double()
    if group is not None:
        dist.all_reduce(counts, group=group)
    if across is not None:
        across(counts)
    weight = (counts[0] / counts[1].clamp(min=1)).float()
    for x, c in zip(labels, chosen):
        x[..., SFT] = torch.where(c, weight, 0.0).view(torch.int32).to(torch.int64)


def build_objective(cfg: JobConfig, loss_parallel: bool, cp_group: dist.ProcessGroup | None) -> LossFn:
    """The run's loss: a PreferenceLoss for preference data, else titanlite.loss.build_loss_fn's."""
    if cfg.data.format != "preference":
        return build_loss_fn(cfg.compile, loss_parallel, cfg.training.z_loss)
    return PreferenceLoss(cfg.preference, 1 if cp_group is None else dist.get_world_size(cp_group), cp_group)


def fake_pairs(ids: torch.Tensor) -> torch.Tensor:
    """Preference labels for `ids` [B, S] as the dry run traces them: each row one pair, its first
    half the chosen response, its second the rejected, every position a target."""
    labels = torch.zeros((*ids.shape, LABEL_CHANNELS), dtype=torch.long)
    labels[..., TOKEN] = ids
    labels[..., RESPONSE] = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long()
    labels[:, 0, PAIR] = 1
    return labels


def wrap(step: Any, parts: list[nn.Module], reference: Callable[[], contextlib.AbstractContextManager] | None,
         sft: bool, group: dist.ProcessGroup) -> Any:
    """The step, with the reference pass where the run has a reference and the SFT term's weights
    where it has one (preference.sft_weight)."""
    return step if reference is None and not sft else PreferenceStep(step, parts, reference, sft, group)
