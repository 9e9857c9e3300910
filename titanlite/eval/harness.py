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

from titanlite.data.packing import IGNORE_INDEX
from titanlite.eval.requests import Request, lm_eval_continuations, lm_eval_rolling
from titanlite.generate import context_length, generate
from titanlite.generate.load import load_model, load_tokenizer
from titanlite.layers.attention import AttnContext
from titanlite.loss import segment_sums, token_logprobs


@torch.no_grad()
def score(model: torch.nn.Module, requests: list[Request], batch_size: int) -> list[tuple[float, bool]]:
    """(log-likelihood of its targets, whether greedy decoding gives them) of each request, longest
    first in batches of `batch_size` right-padded rows (causal: padding changes no earlier logit)."""
    device = next(model.parameters()).device
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    for at in range(0, len(order), batch_size):
        idx = order[at:at + batch_size]
        length = len(requests[idx[0]].tokens) - 1
        ids = torch.zeros(len(idx), length, dtype=torch.long)
        labels = torch.full((len(idx), length), IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(idx):
            r = requests[i]
            n = len(r.tokens) - 1
            ids[row, :n] = torch.tensor(r.tokens[:-1])
            labels[row, n - r.n_target:n] = torch.tensor(r.tokens[n - r.n_target + 1:])
        ids, labels = ids.to(device), labels.to(device)
        logits = model(ids, AttnContext())
        lp = token_logprobs(logits, labels).double()
        target = labels != IGNORE_INDEX
        rows = torch.arange(len(idx), device=device)[:, None].expand_as(labels)
        lls = segment_sums(lp, torch.where(target, rows, -1), len(idx))
        misses = segment_sums((logits.argmax(-1) != labels).double(), torch.where(target, rows, -1), len(idx))
        for row, i in enumerate(idx):
            out[i] = (lls[row].item(), misses[row].item() == 0)
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
        return score(self.model, asked, self.batch_size)

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        tok = self.tokenizer
        asked = lm_eval_rolling([r.args[0] for r in requests], tok.encode, tok.bos_id, self.max_length)
        out = [0.0] * len(requests)
        for r, (ll, _) in zip(asked, score(self.model, asked, self.batch_size)):
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
