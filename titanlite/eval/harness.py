"""A titanlite checkpoint as an lm-eval model ("titanlite", registered on import): any folder
titanlite.generate.load.load_model takes, scored by titanlite's own forward in one process.

Requests are asked as lm-eval's `hf` model asks them (titanlite.eval.requests: the same
tokenization of a context and its continuation, the same left truncation to the model's
context, the same rolling windows, the tokenizer's BOS, else EOS, before an empty context), so a
task's log-likelihoods equal transformers' on the exported folder. Importing this module imports
lm-eval (the `eval` extra); training never does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from titanlite.eval.requests import Request, lm_eval_continuations, lm_eval_rolling
from titanlite.generate import context_length, generate
from titanlite.generate.load import load_model, load_tokenizer
from titanlite.layers.attention import AttnContext
from titanlite.layers.cache import Cache
from titanlite.loss import CHUNK_BYTES, segment_sums


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension (the vocabulary) of [N, vocab] logits in float32, in
    chunks of titanlite.loss.CHUNK_BYTES."""
    rows = max(1, CHUNK_BYTES // (4 * x.shape[-1]))
    return torch.cat([torch.logsumexp(part.float(), -1) for part in x.split(rows)])


@torch.no_grad()
def score(model: torch.nn.Module, requests: list[Request], batch_size: int, context: int) -> list[tuple[float, bool]]:
    """(log-likelihood of its targets, whether greedy decoding gives them) of each request.

    Requests with the same context (the tokens before their first target: a multiple-choice
    question's choices) share one forward of it: at most `batch_size` requests (and so contexts)
    at a time, longest contexts first, left-padded into a generation cache (titanlite.layers.cache, as titanlite.generate prefills
    prompts), whose last logits predict each continuation's first target; the cache is then
    copied to one row per request and the continuations' own tokens run after it, right-padded
    (causal: padding changes no earlier logit). A question's N choices so cost one context and N
    continuations, where lm-eval's hf model runs N rows of context and continuation (it shares a
    row only between choices of one token). log p = logit - logsumexp in float32, summed in float64.
    `context`: the model's positions (pads past a row's end are held at the last)."""
    device = next(model.parameters()).device
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(tuple(r.tokens[:-r.n_target]), []).append(i)
    # at most batch_size continuations (and so contexts) per forward, longest contexts first
    pieces = sorted(((c, members[k:k + batch_size]) for c, members in groups.items()
                     for k in range(0, len(members), batch_size)), key=lambda p: -len(p[0]))
    batches: list[list[tuple[tuple[int, ...], list[int]]]] = [[]]
    for piece in pieces:
        if sum(len(m) for _, m in batches[-1]) + len(piece[1]) > batch_size:
            batches.append([])
        batches[-1].append(piece)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    for batch in batches:
        contexts = [c for c, _ in batch]
        longest = len(contexts[0])
        asked = [i for _, members in batch for i in members]
        targets = [requests[i].tokens[-requests[i].n_target:] for i in asked]
        width = max(map(len, targets)) - 1  # the continuations' inputs: their targets but the last
        ids = torch.zeros(len(contexts), longest, dtype=torch.long)
        for b, c in enumerate(contexts):
            ids[b, longest - len(c):] = torch.tensor(c)
        cache = Cache(torch.tensor([longest - len(c) for c in contexts], device=device), longest + width)
        first = model(ids.to(device), AttnContext(positions=cache.positions(longest), past=cache))[:, -1]
        cache.advance(longest)
        rows = torch.tensor([b for b, (_, members) in enumerate(batch) for _ in members], device=device)
        logits = first[rows][:, None]  # [requests, 1 + width, vocab]: what predicts each target
        if width:
            cache = cache.select(rows)
            feed = torch.zeros(len(asked), width, dtype=torch.long)
            for k, t in enumerate(targets):
                feed[k, :len(t) - 1] = torch.tensor(t[:-1])
            positions = cache.positions(width).clamp(max=context - 1)
            logits = torch.cat([logits, model(feed.to(device), AttnContext(positions=positions, past=cache))], 1)
        where = [(k, j, tok) for k, t in enumerate(targets) for j, tok in enumerate(t)]
        row, pos, target = torch.tensor(where, device=device).unbind(1)
        picked = logits[row, pos]  # [targets, vocab]
        lp = (picked.gather(1, target[:, None])[:, 0].float() - _logsumexp(picked)).double()
        lls = segment_sums(lp, row, len(asked))
        misses = segment_sums((picked.argmax(-1) != target).double(), row, len(asked))
        for i, ll, miss in zip(asked, lls.tolist(), misses.tolist()):
            out[i] = (ll, miss == 0)
    return out


@register_model("titanlite")
class TitanliteLM(LM):
    """lm_eval.simple_evaluate(model="titanlite", model_args={"path": ..., "format": "dcp" or "hf"})."""

    def __init__(self, path: str, format: str = "dcp", tokenizer: str = "", name: str = "",
                 batch_size: int | str = 8, max_length: int = 0, device: str = "cpu") -> None:
        super().__init__()
        self.model, _, _ = load_model(path, format, name, device)
        self.tokenizer, _ = load_tokenizer(tokenizer, Path(path), format)
        self.batch_size = int(batch_size)
        self.max_length = max_length or context_length(self.model)

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        tok = self.tokenizer
        asked = lm_eval_continuations([r.args for r in requests], tok.encode, tok.bos_id, self.max_length)
        return score(self.model, asked, self.batch_size, self.max_length)

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        tok = self.tokenizer
        asked = lm_eval_rolling([r.args[0] for r in requests], tok.encode, tok.bos_id, self.max_length)
        out = [0.0] * len(requests)
        for r, (ll, _) in zip(asked, score(self.model, asked, self.batch_size, self.max_length)):
            out[r.example] += ll
        return out

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Greedy (or sampled, as the request's gen_kwargs say) continuations up to a stop string."""
        tok, out = self.tokenizer, []
        for r in requests:
            context, kwargs = r.args
            until = kwargs.get("until", [])
            steps = kwargs.get("max_gen_toks", 256)
            prompt = tok.encode(context)[-(self.max_length - steps):] or [tok.bos_id]
            (g,) = generate(self.model, [prompt], max_new_tokens=steps,
                            temperature=kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0,
                            eos_ids=[tok.eos_id], stop=[until] if isinstance(until, str) else until,
                            decode=tok.decode)
            out.append(g.text)
        return out
