"""The built-in tasks, made at start from the embedded standard-library source as the built-in
chat set is (titanlite.data.chat_set.stdlib_functions): the same on every run of one Python
version, needing nothing downloaded. Examples are taken from the held-out end of the source
order (the last functions: the chat set's holdout tail), every choice a function of the names."""

from __future__ import annotations

import zlib

from titanlite.data.chat_set import StdlibFunction, stdlib_functions
from titanlite.eval.tasks import Task

SIZE = 500
"""Examples per built-in task (eval.limit takes the first of them)."""


def _pick(name: str, n: int) -> int:
    return zlib.crc32(name.encode()) % n


def which(functions: list[StdlibFunction]) -> Task:
    """Which function does this docstring describe: the function and 3 others of the set, in an
    order fixed by its name."""
    rows = []
    for i, f in enumerate(functions):
        others = [functions[(i + 1 + _pick(f.qualname + str(k), len(functions) - 1)) % len(functions)].qualname
                  for k in range(3)]
        if f.qualname in others or len(set(others)) < 3:
            continue
        gold = _pick(f.qualname, 4)
        choices = [f" {q}" for q in others[:gold] + [f.qualname] + others[gold:]]
        rows.append({"context": f"{f.answer}\nThis is", "choices": choices, "gold": gold})
    return Task("stdlib_which", "choice", rows[-SIZE:])


def make(name: str) -> Task:
    functions = stdlib_functions()
    if name == "stdlib_which":
        return which(functions)
    if name == "stdlib_doc_bpb":
        return Task(name, "bpb", [{"text": f.answer} for f in functions[-SIZE:]])
    # stdlib_signature: the rest of a one-line `def` after its name and parenthesis
    rows = [{"prompt": f"# {f.qualname}\ndef {f.line.split('(', 1)[0]}(", "answer": f.line.split("(", 1)[1]}
            for f in functions if f.line]
    return Task(name, "exact", rows[-SIZE:])
