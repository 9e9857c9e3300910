"""Text generation: `generate(model, prompts, ...)`, the one loop the command line, evaluation and
RL call. The prompts are left-padded into one batch and run once (prefill) into a cache
(titanlite.layers.cache), then each step feeds every row's new token alone. Each attention kind
keeps its own past in the cache, so this loop is the same for every family.

Picking a token: temperature 0 is greedy (the first of equal logits, as torch.argmax and
transformers pick); otherwise the logits are divided by the temperature and filtered by top_k,
then top_p, then min_p (transformers' order), and a token drawn from the softmax with the
row's own generator, seeded by (seed, the prompt's index): a prompt's sample does not depend on
the others in the batch.

`python -m titanlite.generate` is the command line (__main__.py; models read by load.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titanlite.layers.attention import AttnContext
from titanlite.layers.cache import Cache


@dataclass(frozen=True)
class Sampling:
    """How a token is picked from a step's logits (the module doc)."""

    temperature: float = 0.0
    """0: greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (those tied with the k-th included); 0: all."""
    top_p: float = 1.0
    """Keep the most likely tokens until their probabilities sum to top_p (nucleus), in (0, 1]."""
    min_p: float = 0.0
    """Keep the tokens at least min_p times as likely as the most likely one, in [0, 1]."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature is {self.temperature}; use 0 (greedy) or more")
        if self.top_k < 0:
            raise ValueError(f"top_k is {self.top_k}; use 0 (off) or more")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p}; it must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p is {self.min_p}; it must be in [0, 1]")


@dataclass
class Generation:
    """One prompt's result."""

    prompt_ids: list[int]
    ids: list[int]
    """The generated tokens, the EOS that ended them included."""
    text: str | None = None
    """The generated text (without an EOS, cut before a stop string); None without a decoder."""
    finish: str = "length"
    """Why it ended: "eos", "stop" (a stop string), "length" (max_new_tokens) or "context" (the
    model's context is full)."""
    logits: torch.Tensor | None = None
    """[len(ids), vocab] float32 logits each token was picked from (with keep_logits)."""


class FullLogits(nn.Module):
    """A training model for generation (RL's rollouts, in-loop evaluation): its logits whole
    where loss parallel leaves them vocab-sharded."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, ctx) -> torch.Tensor:
        out = self.model(tokens, ctx)
        return out.full_tensor() if isinstance(out, DTensor) else out


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [B, V] with -inf at every token top_k, top_p or min_p removes (in that order)."""
    out = logits.clone()
    if sampling.top_k and sampling.top_k < out.shape[-1]:
        kth = out.topk(sampling.top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if sampling.top_p < 1:
        probs, order = out.softmax(-1).sort(dim=-1, descending=True)
        # a token stays if the tokens more likely than it sum to less than top_p: the smallest
        # prefix reaching top_p, the most likely token always in it
        before = probs.cumsum(-1) - probs
        out = out.masked_fill(torch.zeros_like(out, dtype=torch.bool).scatter(-1, order, before >= sampling.top_p),
                              float("-inf"))
    if sampling.min_p:
        probs = out.softmax(-1)
        out = out.masked_fill(probs < sampling.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return out


def row_generator(seed: int, index: int) -> torch.Generator:
    """The generator of prompt `index` under `seed` (CPU; the draw is from CPU probabilities)."""
    return torch.Generator().manual_seed((seed << 24) + index)


def pick(logits: torch.Tensor, sampling: Sampling, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """[B] the token of each row: argmax at temperature 0, else a draw with the row's generator."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / sampling.temperature, sampling).softmax(-1).cpu()
    drawn = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)]
    return torch.cat(drawn).to(logits.device)


def context_length(model: nn.Module) -> int:
    """The positions the model's RoPE tables cover: its args' max_seq_len, or a transformers
    model's max_position_embeddings (the transformers family)."""
    args = getattr(model, "args", None)
    if args is not None:
        return args.max_seq_len
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "max_position_embeddings", None):
        raise ValueError("generate: the model has no args or config giving its context length; pass context=")
    return config.max_position_embeddings


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int | Sequence[int] = 0, eos_ids: Sequence[int] = (), stop: Sequence[str] = (),
             decode: Callable[[list[int]], str] | None = None, pad_id: int = 0, keep_logits: bool = False,
             context: int | None = None, everyone: Callable[[bool], bool] | None = None) -> list[Generation]:
    """Continue each prompt (token ids) by up to `max_new_tokens` tokens with `model`, any family's
    titanlite model called as model(tokens, AttnContext). `seed`: one seed (prompt i draws with
    (seed, i)) or one per prompt; `eos_ids` end a prompt's generation; `stop` strings end it once
    `decode` (ids -> text) shows one; `context`: the most tokens a prompt may reach (default the
    model's); `everyone`: where ranks run the model together (FSDP gathers each layer), this rank's
    "still running" in, whether any rank's is out, so that every rank runs the same forwards.
    Returns one Generation per prompt, in order."""
    sampling = Sampling(temperature, top_k, top_p, min_p)
    context = context_length(model) if context is None else context
    if not prompts:
        return []
    if stop and decode is None:
        raise ValueError("generate: stop strings need decode (ids -> text)")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"generate: prompt {lengths.index(0)} is empty; a prompt needs one token at least")
    longest = max(lengths)
    if longest >= context:
        i = lengths.index(longest)
        raise ValueError(f"generate: prompt {i} has {longest} tokens, the model's context is {context}; "
                         f"shorten it to at most {context - 1}")
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
    generators = [row_generator(s, i if isinstance(seed, int) else 0) for i, s in enumerate(seeds)]
    device = next(model.parameters()).device
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p):] = torch.tensor(list(p), dtype=torch.long)
    start = torch.tensor([longest - n for n in lengths], device=device)
    cache = Cache(start, longest + max_new_tokens)
    out = [Generation(list(p), []) for p in prompts]
    steps = [[] for _ in prompts]
    limit = [min(max_new_tokens, context - n) for n in lengths]
    running = [n > 0 for n in limit]
    for g, n in zip(out, limit):
        g.finish = "length" if n == max_new_tokens else "context"
    feed = tokens.to(device)
    # eval mode whatever the caller's (RL's policy trains between rollouts): no adapter dropout,
    # and no MoE load counted towards the next router-bias update
    training = model.training
    model.eval()
    try:
        while any(running) if everyone is None else everyone(any(running)):
            # a finished row runs on beside the others (rows are independent), within the RoPE tables
            positions = cache.positions(feed.shape[1]).clamp(max=context - 1)
            logits = model(feed, AttnContext(positions=positions, past=cache))[:, -1].float()
            cache.advance(feed.shape[1])
            feed = pick(logits, sampling, generators)[:, None]
            _record(out, feed[:, 0].tolist(), logits if keep_logits else None, steps, running, eos_ids, stop, decode,
                    limit)
    finally:
        model.train(training)
    for g, logits in zip(out, steps):
        if decode is not None and g.text is None:
            g.text = decode(g.ids[:-1] if g.finish == "eos" else g.ids)
        if keep_logits:
            g.logits = torch.stack(logits)
    return out


def _record(out: list[Generation], chosen: list[int], logits: torch.Tensor | None, steps: list[list[torch.Tensor]],
            running: list[bool], eos_ids: Sequence[int], stop: Sequence[str],
            decode: Callable[[list[int]], str] | None, limit: list[int]) -> None:
    """Append each running row's token (and logits) to its generation; stop the rows that end."""
    for i, token in enumerate(chosen):
        if not running[i]:
            continue
        out[i].ids.append(token)
        if logits is not None:
            steps[i].append(logits[i].cpu())
        running[i] = _goes_on(out[i], token, eos_ids, stop, decode, limit[i])


def _goes_on(g: Generation, token: int, eos_ids: Sequence[int], stop: Sequence[str],
             decode: Callable[[list[int]], str] | None, limit: int) -> bool:
    """Whether generation `g` continues after `token`; sets its finish (and text at a stop)."""
    if token in eos_ids:
        g.finish = "eos"
        return False
    if stop:
        text = decode(g.ids)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            g.finish, g.text = "stop", text[:min(hits)]
            return False
    return len(g.ids) < limit
