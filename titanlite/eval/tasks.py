"""Evaluation tasks read from a jsonl file per task, every row checked before launch (the built-in
ones are made by titanlite.eval.builtin; titanlite.eval.score.load_tasks gathers both).

Kinds, by the keys of a file's rows:
- choice: {"context": str, "choices": [str, ...], "gold": int}; each choice continues the context
  as written (put any space before it in the choice);
- bpb: {"text": str};
- exact: {"prompt": str, "answer": str}; the generation up to its first newline, stripped, must
  equal the answer stripped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from titanlite.errors import ConfigError

KINDS = {"choice": ("context", "choices", "gold"), "bpb": ("text",), "exact": ("prompt", "answer")}
"""A task kind -> the keys of its rows."""


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    rows: list[dict]


def _check_row(row: object, kind: str, where: str) -> None:
    if not isinstance(row, dict) or set(KINDS[kind]) - set(row):
        raise ConfigError(f"{where}: a {kind} task's row needs the keys {', '.join(KINDS[kind])}")
    if kind == "choice":
        choices, gold = row["choices"], row["gold"]
        if not isinstance(row["context"], str) or not isinstance(choices, list) or len(choices) < 2 \
                or not all(isinstance(c, str) and c for c in choices):
            raise ConfigError(f"{where}: context must be a string and choices a list of 2 or more non-empty strings")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
            raise ConfigError(f"{where}: gold {gold!r} is not an index of its {len(choices)} choices "
                              f"(0 to {len(choices) - 1})")
    elif not all(isinstance(row[k], str) and (row[k] or k == "answer") for k in KINDS[kind]):
        raise ConfigError(f"{where}: {', '.join(KINDS[kind])} must be non-empty strings")


def read_task(path: str | Path, limit: int = 0) -> Task:
    """A jsonl task file, every row checked (up to `limit` rows, 0: all); its kind by the first row's keys."""
    path = Path(path)
    rows, kind = [], None
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"eval.tasks: {path} row {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} is not JSON ({e.msg})") from None
            if kind is None:
                kind = next((k for k, keys in KINDS.items() if isinstance(row, dict) and keys[0] in row), None)
                if kind is None:
                    raise ConfigError(f"{where}: a row needs context/choices/gold (multiple choice), text "
                                      "(bits per byte) or prompt/answer (exact match)")
            _check_row(row, kind, where)
            rows.append(row)
            if len(rows) == limit:
                break
    if not rows:
        raise ConfigError(f"eval.tasks: {path} has no rows")
    return Task(path.stem, kind, rows)
