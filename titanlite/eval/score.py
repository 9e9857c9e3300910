"""In-loop evaluation on the training layout: no gather of the model to one rank.

Requests (titanlite.eval.requests) are split over the data-parallel ranks by index (request i on
rank i mod dp), one request per sequence of training.seq_len tokens, eval.batch_size sequences per
forward; every rank runs the same number of forwards (a short rank's last batch is padding), as
FSDP's collectives need. Each request's log-likelihood is the sum of its target tokens'
titanlite.loss.token_logprobs (the training loss's terms) by titanlite.loss.segment_sums, in
float64, on this rank's share of the sequence (context parallel), on the last pipeline stage
(the others hold zeros); one all-reduce over the loss group (pp x dp x cp; tensor-parallel ranks
hold the same sums) gives every rank every request's value, so the metrics are those of one
process on any layout. Exact-match prompts go through titanlite.generate.generate on the
training model (its logits gathered whole under loss parallel), split the same way, each rank
running max_new_tokens decode steps; context-parallel ranks generate the same prompts on the
whole sequence. Where a one-token decode step cannot run (`by_whole_rows`: pipeline stages run
only the training shape, sequence parallel splits the sequence over the tensor-parallel ranks,
MoE blocks under tensor parallel route each tp rank's own share of it), there is no
cache: each step runs every row (prompt and tokens so far) whole through the stages (its sequence
sharded as training's under context parallel), and the greedy token at each row's last position,
on the last stage (and the cp rank holding it), reaches every rank by the same all-reduce.
Nothing here draws from the training RNG or reads the training data.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from titanlite.config.eval import BUILTIN_TASKS, Eval
from titanlite.data.packing import IGNORE_INDEX
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import ConfigError
from titanlite.eval.requests import Request, first_line, task_requests, task_metrics
from titanlite.eval import builtin
from titanlite.eval.tasks import Task, read_task
from titanlite.generate import FullLogits, generate
from titanlite.loss import segment_sums


def load_tasks(cfg: Eval) -> list[Task]:
    """The tasks eval.tasks names, each cut to eval.limit examples."""
    out = []
    for name in cfg.tasks:
        if name in BUILTIN_TASKS:
            task = builtin.make(name)
            out.append(Task(task.name, task.kind, task.rows[:cfg.limit or None]))
        elif name.endswith(".jsonl"):
            out.append(read_task(name, cfg.limit))
        else:  # an lm-eval task: lm-eval is imported here, only where one is named
            from titanlite.eval.lmtasks import lm_eval_task
            out.append(lm_eval_task(name, cfg.include_path))
    return out


def by_whole_rows(pp: int, tp: int, ep: int, sequence_parallel: bool) -> bool:
    """Whether exact match runs whole rows at the training shape (Evaluator.exact_match_staged)
    rather than a cached decode, one token a step, which pipeline stages, sequence parallel and MoE
    blocks under tensor parallel (each tensor-parallel rank routes its own share of the sequence;
    the decode hung there) cannot run."""
    return pp > 1 or (tp > 1 and (sequence_parallel or ep > 1))


def check_layout(cfg: Eval, tasks: list[Task], seq_len: int, pp: int, tp: int, ep: int) -> None:
    """What the loop cannot score, refused before launch: exact match with no room for a prompt,
    and under pipeline parallel with MoE blocks under tensor parallel (not tried)."""
    if any(t.kind == "exact" for t in tasks) and cfg.max_new_tokens >= seq_len:
        raise ConfigError(f"eval.max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt in training.seq_len "
                          f"{seq_len}; lower it")
    exact = [t.name for t in tasks if t.kind == "exact"]
    if exact and pp > 1 and tp > 1 and ep > 1:
        raise ConfigError(f"eval.tasks: exact-match task {exact[0]} is not scored under pipeline parallel with MoE "
                          "blocks under tensor parallel (not tried); drop it from eval.tasks or score it with "
                          "python -m titanlite.eval")


# a step's eval_rows: fn(logits, labels) of a prepared batch, [rows, seq] of a dtype
StageRows = Callable[[dict, Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.dtype], torch.Tensor]


def greedy_at_marks(logits: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """[rows, seq]: the greedy token (the first of equal logits, as generate picks) at each position
    whose mark is not IGNORE_INDEX, 0 elsewhere. Vocabulary-sharded logits (loss parallel) are
    gathered at those positions only, not the whole batch's."""
    at = (marks != IGNORE_INDEX).nonzero(as_tuple=True)
    picked = (logits.to_local() if isinstance(logits, DTensor) else logits)[at]
    if isinstance(logits, DTensor):
        if any(isinstance(p, Shard) and p.dim % logits.ndim != logits.ndim - 1 for p in logits.placements):
            raise ValueError(f"exact match: logits sharded as {logits.placements}, not on the vocabulary")
        vocab = logits.shape[-1]
        picked = DTensor.from_local(picked, logits.device_mesh, [Shard(1) if p.is_shard() else p
                                                                 for p in logits.placements],
                                    shape=(len(picked), vocab), stride=(vocab, 1)).full_tensor()
    out = torch.zeros_like(marks)
    out[at] = picked.float().argmax(-1)
    return out


def _batches(n: int, rank: int, degree: int, size: int) -> list[list[int]]:
    """This rank's request indices in batches of `size`; every rank gets as many batches."""
    mine = list(range(rank, n, degree))
    per_rank = -(-n // degree)
    count = -(-per_rank // size)
    return [mine[b * size:(b + 1) * size] for b in range(count)]


@dataclass
class Evaluator:
    cfg: Eval
    tokenizer: Tokenizer
    seq_len: int
    dp_rank: int
    dp_degree: int
    group: dist.ProcessGroup | None
    """The loss group: request sums add up over it."""

    def __post_init__(self) -> None:
        self.tasks = load_tasks(self.cfg)
        eos = self.tokenizer.eos_id
        self.requests = {t.name: task_requests(t, self.tokenizer.encode, eos, self.seq_len)
                         for t in self.tasks if t.kind in ("choice", "bpb")}

    def due(self, step: int, last_step: int) -> bool:
        return bool(self.tasks) and (step % self.cfg.interval == 0 or step == last_step)

    def log_likelihoods(self, requests: list[Request], prepare: Callable[[dict], dict],
                        logprobs: Callable[[dict], torch.Tensor], device: torch.device) -> torch.Tensor:
        """[len(requests)] float64 log-likelihoods, the same on every rank."""
        size, length = self.cfg.batch_size, self.seq_len
        out = torch.zeros(len(requests), dtype=torch.float64, device=device)
        for idx in _batches(len(requests), self.dp_rank, self.dp_degree, size):
            ids = torch.zeros(size, length, dtype=torch.long)
            labels = torch.full((size, length), IGNORE_INDEX, dtype=torch.long)
            for row, i in enumerate(idx):
                r = requests[i]
                n = len(r.tokens) - 1
                ids[row, :n] = torch.tensor(r.tokens[:-1])
                labels[row, n - r.n_target:n] = torch.tensor(r.tokens[n - r.n_target + 1:])
            batch = prepare({"input_ids": ids, "labels": labels})
            lp = logprobs(batch).double()
            rows = torch.arange(size, device=lp.device)[:, None].expand_as(lp)
            segments = torch.where(batch["labels"] != IGNORE_INDEX, rows, -1)
            sums = segment_sums(lp, segments, size)[:len(idx)].to(device)
            out[torch.tensor(idx, dtype=torch.long, device=device)] += sums
        dist.all_reduce(out, group=self.group)
        return out

    def exact_match(self, task: Task, model: nn.Module, device: torch.device) -> float:
        """The share of prompts whose greedy generation's first line equals the answer."""
        tok, steps = self.tokenizer, self.cfg.max_new_tokens
        hits = torch.zeros(len(task.rows), dtype=torch.float64, device=device)
        for idx in _batches(len(task.rows), self.dp_rank, self.dp_degree, self.cfg.batch_size):
            # prompts cut to leave room for every step: each rank runs exactly `steps` forwards
            prompts = [([tok.eos_id] + tok.encode(task.rows[i]["prompt"]))[-(self.seq_len - steps):] for i in idx]
            gens = generate(FullLogits(model), prompts or [[tok.eos_id]], max_new_tokens=steps, context=self.seq_len)
            for i, g in zip(idx, gens):
                hits[i] = float(first_line(tok.decode(g.ids)) == task.rows[i]["answer"].strip())
        # max, not sum: context-parallel ranks generate the same prompts, each on the whole sequence
        dist.all_reduce(hits, dist.ReduceOp.MAX, group=self.group)
        return hits.mean().item()

    def exact_match_staged(self, task: Task, rows: StageRows, prepare: Callable[[dict], dict],
                           device: torch.device) -> float:
        """exact_match where a decode step cannot run (by_whole_rows; the module doc): `steps`
        forwards of the whole rows per batch on every rank, the chosen tokens summed over the loss
        group (zeros off the last stage, and on the context-parallel ranks that do not hold a row's
        last position) in one [dp, batch] tensor, each data-parallel rank's rows in its own line."""
        tok, steps, size, length = self.tokenizer, self.cfg.max_new_tokens, self.cfg.batch_size, self.seq_len
        hits = torch.zeros(len(task.rows), dtype=torch.float64, device=device)
        for idx in _batches(len(task.rows), self.dp_rank, self.dp_degree, size):
            rows_so_far = [([tok.eos_id] + tok.encode(task.rows[i]["prompt"]))[-(length - steps):] for i in idx]
            for _ in range(steps):
                ids = torch.zeros(size, length, dtype=torch.long)
                marks = torch.full((size, length), IGNORE_INDEX, dtype=torch.long)
                for row, seq in enumerate(rows_so_far):
                    ids[row, :len(seq)] = torch.tensor(seq)
                    marks[row, len(seq) - 1] = 0  # the position whose next token is picked
                chosen = torch.zeros(self.dp_degree, size, dtype=torch.long, device=device)
                chosen[self.dp_rank] = rows(prepare({"input_ids": ids, "labels": marks}), greedy_at_marks,
                                            torch.long).sum(1)
                dist.all_reduce(chosen, group=self.group)
                for seq, token in zip(rows_so_far, chosen[self.dp_rank].tolist()):
                    seq.append(token)
            for i, seq in zip(idx, rows_so_far):
                hits[i] = float(first_line(tok.decode(seq[-steps:])) == task.rows[i]["answer"].strip())
        dist.all_reduce(hits, dist.ReduceOp.MAX, group=self.group)  # pp and cp ranks hold the same hits
        return hits.mean().item()

    def __call__(self, parts: list[nn.Module], prepare: Callable[[dict], dict],
                 logprobs: Callable[[dict], torch.Tensor], device: torch.device,
                 rows: StageRows | None = None) -> dict[str, float]:
        """{"eval/<task>/<metric>": value, ..., "eval/seconds": this evaluation's time}. `rows`: the
        step's eval_rows where by_whole_rows holds (exact match runs through it)."""
        start = time.perf_counter()
        for part in parts:
            part.eval()
        out = {}
        with torch.no_grad():
            for task in self.tasks:
                if task.kind == "exact":
                    out[f"eval/{task.name}/exact_match"] = (self.exact_match(task, parts[0], device) if rows is None
                                                            else self.exact_match_staged(task, rows, prepare, device))
                    continue
                if task.kind == "lm_eval":  # titanlite.eval.lmtasks: lm-eval's requests and metrics
                    out.update(task.metrics(self.tokenizer, self.seq_len, self.cfg.limit,
                                            lambda asked: self.log_likelihoods(asked, prepare, logprobs, device)))
                    continue
                lls = self.log_likelihoods(self.requests[task.name], prepare, logprobs, device).tolist()
                out.update({f"eval/{task.name}/{k}": v for k, v in task_metrics(task, lls).items()})
        for part in parts:
            part.train()
        out["eval/seconds"] = time.perf_counter() - start
        return out
