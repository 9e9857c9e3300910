"""Tasks as scoring requests, and metrics from their log-likelihoods; no model, no process group.

A request is one sequence of at most `seq_len` + 1 tokens whose last `n_target` tokens are
scored (lm-eval's `loglikelihood` of a continuation, or one window of `loglikelihood_rolling`);
the in-loop scorer (titanlite.eval.score) and the lm-eval model class (titanlite.eval.harness)
both turn requests into log-likelihoods, so a metric means the same in both.

Metrics (ll: a continuation's summed natural-log probability):
- choice: acc (argmax of ll is gold), acc_norm (argmax of ll / characters of the choice, as
  lm-eval), bpb (sum of -ll of gold choices / (ln 2 x their UTF-8 bytes), over the task);
- bpb: sum of -ll of the texts / (ln 2 x their UTF-8 bytes) (lm-eval's bits_per_byte);
- exact: exact_match, the share of prompts whose generation matched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titanlite.eval.tasks import Task


@dataclass(frozen=True)
class Request:
    tokens: list[int]
    """Input tokens and the next one (at most seq_len + 1)."""
    n_target: int
    """How many of the last tokens are scored."""
    example: int
    """The example (a choice's, a text window's) whose log-likelihood it adds to."""


def continuation(encode: Callable[[str], list[int]], context: str, cont: str, prefix: Sequence[int],
                 seq_len: int, example: int) -> Request:
    """log p(cont | context) as lm-eval's HF model asks it: the continuation's tokens are those of
    context + cont past the context's own (a trailing space of the context moves to cont first);
    the context is cut from the left to fit; `prefix` starts the context (lm-eval: the end-of-text
    token where the context is empty; in the loop: the EOS that precedes every training document)."""
    gap = len(context) - len(context.rstrip())
    if gap:
        context, cont = context[:-gap], context[-gap:] + cont
    ctx = list(prefix) + encode(context)
    whole = list(prefix) + encode(context + cont)
    cont_ids = whole[len(ctx):]
    tokens = (ctx + cont_ids)[-(seq_len + 1):]
    return Request(tokens, min(len(cont_ids), seq_len), example)


def rolling(ids: list[int], prefix: int, seq_len: int, example: int) -> list[Request]:
    """lm-eval's loglikelihood_rolling of a text's tokens: every token scored once, the first after
    `prefix`, in windows of seq_len targets; each window after the first sees the seq_len tokens
    before its last target (the last window may overlap the one before it in input, never in targets)."""
    full = [prefix] + ids
    out, done = [], 0
    while done < len(ids):
        end = min(done + seq_len, len(ids))  # targets full[done + 1 .. end]
        start = max(0, end - seq_len)
        out.append(Request(full[start:end + 1], end - done, example))
        done = end
    return out


def lm_eval_continuations(pairs: Sequence[tuple[str, str]], encode: Callable[[str], list[int]], bos: int,
                          seq_len: int) -> list[Request]:
    """lm-eval's `loglikelihood` requests (context, continuation) as its `hf` model asks them: the
    tokenizer's BOS (else EOS) before an empty context only. Both the lm-eval model class and
    lm-eval task names in eval.tasks build theirs here, so their scores agree."""
    return [continuation(encode, ctx, cont, [] if ctx else [bos], seq_len, i) for i, (ctx, cont) in enumerate(pairs)]


def lm_eval_rolling(texts: Sequence[str], encode: Callable[[str], list[int]], bos: int, seq_len: int) -> list[Request]:
    """lm-eval's `loglikelihood_rolling` requests of `texts`: each text's windows, `example` its index."""
    return [w for i, text in enumerate(texts) for w in rolling(encode(text), bos, seq_len, i)]


def task_requests(task: Task, encode: Callable[[str], list[int]], prefix: int, seq_len: int) -> list[Request]:
    """The requests of a choice or bpb task, in example order (a choice's by choice)."""
    if task.kind == "choice":
        return [continuation(encode, row["context"], c, [prefix], seq_len, i)
                for i, row in enumerate(task.rows) for c in row["choices"]]
    return [r for i, row in enumerate(task.rows) for r in rolling(encode(row["text"]), prefix, seq_len, i)]


def task_metrics(task: Task, lls: Sequence[float]) -> dict[str, float]:
    """The metrics of a choice or bpb task from its requests' log-likelihoods (task_requests' order)."""
    if task.kind == "bpb":
        return {"bpb": -sum(lls) / (math.log(2) * sum(len(r["text"].encode()) for r in task.rows))}
    acc = acc_norm = 0
    nll_gold = gold_bytes = 0.0
    at = 0
    for row in task.rows:
        k = len(row["choices"])
        ll = list(lls[at:at + k])
        at += k
        gold = row["gold"]
        acc += max(range(k), key=lambda i: ll[i]) == gold
        acc_norm += max(range(k), key=lambda i: ll[i] / len(row["choices"][i])) == gold
        nll_gold -= ll[gold]
        gold_bytes += len(row["choices"][gold].encode())
    n = len(task.rows)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "bpb": nll_gold / (math.log(2) * gold_bytes)}


def first_line(text: str) -> str:
    """A generation up to its first newline, stripped: what exact match compares."""
    return text.split("\n", 1)[0].strip()
