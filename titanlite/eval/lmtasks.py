"""lm-eval task names in eval.tasks: a task of lm-eval's (or of a YAML file in eval.include_path)
whose data is on this machine, scored in the training loop by lm-eval's own task objects and
metrics. Imported only where such a name is configured (titanlite.eval.score.load_tasks):
importing this module imports lm-eval, which training otherwise never does.

lm-eval builds the requests and computes the metrics (lm_eval.evaluator.evaluate, every rank
running it as rank 0 of 1 so each gets the whole result); the log-likelihoods come from the
loop's scorer (titanlite.eval.score.Evaluator.log_likelihoods: split over the data-parallel ranks,
summed over the loss group). Requests are asked as `python -m titanlite.eval` asks them
(titanlite.eval.requests.lm_eval_continuations / lm_eval_rolling, with training.seq_len as the
model's context), so on the same weights the scores are that command's. The loop scores
`multiple_choice` and `loglikelihood_rolling` tasks; `loglikelihood` tasks (their `acc` needs
greedy-token checks) and `generate_until` tasks are refused before launch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager

from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import ConfigError
from titanlite.eval.__main__ import no_local_data, offline
from titanlite.eval.requests import Request, lm_eval_continuations, lm_eval_rolling
from titanlite.eval.tasks import Task

SCORED = ("multiple_choice", "loglikelihood_rolling")
"""The output types the loop scores."""
FEWSHOT_SEED = 1234
"""lm-eval's default few-shot seed (simple_evaluate's), set before every evaluation: the same
few-shot examples each time, and those `python -m titanlite.eval` draws."""


@functools.cache
def _manager(include_path: str, defaults: bool) -> TaskManager:
    # indexing lm-eval's own tasks takes seconds: once per process (preflight, then the loop)
    return TaskManager(include_path=include_path or None, include_defaults=defaults)


def _find(name: str, include_path: str) -> TaskManager | None:
    """The task index that knows `name`: eval.include_path's alone where it is there (a local
    task: lm-eval's thousands of own tasks not indexed), else with lm-eval's own; None: neither."""
    if include_path and name in (local := _manager(include_path, False)).all_tasks:
        return local
    manager = _manager(include_path, True)
    return manager if name in manager.all_tasks else None


@dataclass(frozen=True)
class LmEvalTask(Task):
    loaded: dict = field(default_factory=dict)
    """TaskManager.load's {"tasks": ..., "groups": ...} for this name (a group: its subtasks)."""

    def metrics(self, tokenizer: Tokenizer, seq_len: int, limit: int,
                score: Callable[[list[Request]], torch.Tensor]) -> dict[str, float]:
        """{"eval/<lm-eval task>/<metric>": value}: lm-eval's metrics (stderr left out) from the
        log-likelihoods `score` gives the requests."""
        for task in self.loaded["tasks"].values():
            task.set_fewshot_seed(seed=FEWSHOT_SEED)
        out = evaluate(_LoopLM(tokenizer, seq_len, score), self.loaded, limit=limit or None, bootstrap_iters=0,
                       log_samples=False)
        return {f"eval/{name}/{metric.removesuffix(',none').replace(',', '_')}": value
                for name, values in out["results"].items() for metric, value in values.items()
                if isinstance(value, float) and "_stderr" not in metric}


def lm_eval_task(name: str, include_path: str) -> LmEvalTask:
    """An lm-eval task (or group) by name, its data loaded offline; refused in one line when lm-eval
    does not know the name, its data is not on this machine, or the loop cannot score it."""
    offline()
    manager = _find(name, include_path)
    if manager is None:
        raise ConfigError(f"eval.tasks: '{name}' is not a built-in task, a .jsonl task file or an lm-eval task here; "
                          "give one of those, or a folder of lm-eval task YAML files in eval.include_path")
    try:
        loaded = manager.load([name])
    except Exception as e:
        if no_local_data(e):
            raise ConfigError(f"eval.tasks: the data of lm-eval task '{name}' is not on this machine "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); point its dataset_path/"
                              "data_files at local files, or put the data set in the Hugging Face cache") from None
        raise
    for sub, task in loaded["tasks"].items():
        kind = task.get_config("output_type")
        if kind not in SCORED:
            raise ConfigError(f"eval.tasks: lm-eval task '{sub}' is a {kind} task, which the training loop does not "
                              f"score (it scores {' and '.join(SCORED)}); drop it from eval.tasks and score "
                              "checkpoints with python -m titanlite.eval")
        if task.get_config("num_fewshot") is None:  # as simple_evaluate: no default given, zero-shot
            task.set_config(key="num_fewshot", value=0)
    return LmEvalTask(name, "lm_eval", [], loaded)


class _LoopLM(LM):
    """lm-eval's model interface over the loop's scorer; lm-eval sees one process (rank 0 of 1)."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int, score: Callable[[list[Request]], torch.Tensor]) -> None:
        super().__init__()
        self.tokenizer, self.seq_len, self.score = tokenizer, seq_len, score

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        tok = self.tokenizer
        asked = lm_eval_continuations([r.args for r in requests], tok.encode, tok.bos_id, self.seq_len)
        # is_greedy: not computed; no scored output type reads it (loglikelihood tasks are refused)
        return [(ll, False) for ll in self.score(asked).tolist()]

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        tok = self.tokenizer
        asked = lm_eval_rolling([r.args[0] for r in requests], tok.encode, tok.bos_id, self.seq_len)
        out = [0.0] * len(requests)
        for r, ll in zip(asked, self.score(asked).tolist()):
            out[r.example] += ll
        return out

    def generate_until(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("generate_until tasks are refused before launch (lm_eval_task)")
