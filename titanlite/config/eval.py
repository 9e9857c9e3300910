"""The [eval] section (downstream tasks scored in the training loop) and its checks that read
no file beyond a task file's existence. Task files' rows are checked before launch by
titanlite.eval.tasks."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from titanlite.errors import ConfigError

BUILTIN_TASKS = ("stdlib_which", "stdlib_def", "stdlib_doc_bpb", "stdlib_signature")
"""The built-in tasks (titanlite.eval.builtin), made at start from the embedded standard library:
which function a docstring describes (4 choices), which `def` line is a function's own (4 choices,
3 with their parameters' characters shuffled), the docstrings' bits per byte, and the rest of a
function's `def` line (exact match)."""


@dataclass(frozen=True)
class Eval:
    tasks: list[str] = field(default_factory=list)
    """Tasks scored in the training loop: built-in names (stdlib_which, stdlib_def, stdlib_doc_bpb,
    stdlib_signature), .jsonl files (one task each, named by the file's stem) or, with lm-eval
    installed, lm-eval task names whose data is on this machine; empty: off."""
    include_path: str = ""
    """A folder of lm-eval task YAML files, whose task names eval.tasks may then give."""
    interval: int = 100
    """Score the tasks every N steps and after the last step."""
    limit: int = 100
    """Examples per task (the first ones); 0: all of them."""
    batch_size: int = 8
    """Sequences (training.seq_len tokens each) per forward of an evaluation."""
    max_new_tokens: int = 32
    """Tokens generated per prompt by exact-match tasks."""


def check_eval(e: Eval) -> None:
    """The section's own values and each task's name or file (not its rows)."""
    for key, val in [("eval.interval", e.interval), ("eval.batch_size", e.batch_size),
                     ("eval.max_new_tokens", e.max_new_tokens)]:
        if val < 1:
            raise ConfigError(f"{key} must be >= 1, got {val}")
    if e.limit < 0:
        raise ConfigError(f"eval.limit must be >= 0 (0: every example), got {e.limit}")
    if e.include_path and not Path(e.include_path).is_dir():
        raise ConfigError(f"eval.include_path '{e.include_path}' is not a folder (of lm-eval task YAML files)")
    seen = set()
    for task in e.tasks:
        if task in BUILTIN_TASKS:
            name = task
        elif task.endswith(".jsonl"):
            if not Path(task).is_file():
                raise ConfigError(f"eval.tasks: task file '{task}' does not exist")
            name = Path(task).stem
        elif importlib.util.find_spec("lm_eval") is None:  # not imported: training never imports lm-eval
            raise ConfigError(f"eval.tasks: '{task}' is neither a built-in task ({', '.join(BUILTIN_TASKS)}) "
                              "nor a .jsonl task file, and lm-eval (for lm-eval task names) is not installed; "
                              "pip install -e '.[eval]' or drop it")
        else:  # an lm-eval task: its name and data are checked before launch (titanlite.eval.lmtasks)
            name = task
        if name in seen:
            raise ConfigError(f"eval.tasks: two tasks are named '{name}'; rename one file")
        seen.add(name)
