"""The built-in tasks, made at start from the embedded standard-library source as the built-in
chat set is (titanlite.data.chat_set.stdlib_functions): the same on every run of one Python
version, needing nothing downloaded. Examples are the last SIZE functions of the source order,
every choice a function of the names."""

from __future__ import annotations

import random
import zlib

from titanlite.data.chat_set import StdlibFunction, stdlib_functions
from titanlite.eval.tasks import Task

SIZE = 500
"""Examples per built-in task (eval.limit takes the first of them)."""


def _pick(name: str, n: int) -> int:
    return zlib.crc32(name.encode()) % n


def _sample(functions: list[StdlibFunction]) -> list[StdlibFunction]:
    """The last SIZE functions in an order fixed by their names, so that eval.limit's first
    examples are a sample of them rather than the few modules that come first."""
    return sorted(functions[-SIZE:], key=lambda f: zlib.crc32(f.qualname.encode()))


def which(functions: list[StdlibFunction]) -> Task:
    """Which function does this docstring describe: the function and 3 others of the same
    examples, in an order fixed by its name. Drawn from the examples themselves, every name is as
    often a wrong choice as a right one on average, so no kind of name (short ones, one module's)
    scores above chance by itself."""
    pool, rows = _sample(functions), []
    for i, f in enumerate(pool):
        others = [pool[(i + 1 + _pick(f.qualname + str(k), len(pool) - 1)) % len(pool)].qualname for k in range(3)]
        if f.qualname in others or len(set(others)) < 3:
            continue
        gold = _pick(f.qualname, 4)
        choices = [f" {q}" for q in others[:gold] + [f.qualname] + others[gold:]]
        rows.append({"context": f"{f.answer}\nThis is", "choices": choices, "gold": gold})
    return Task("stdlib_which", "choice", rows)


def def_line(functions: list[StdlibFunction]) -> Task:
    """Which is the function's `def` line: the real one or one of 3 with the characters between its
    parentheses shuffled (the same characters, so the same length and letters: only their order,
    which a model learns early, tells them apart). Local byte statistics solve it (a byte-bigram
    count of the standard library picks the real line 99.5% of the time): its rise shows that a
    model learned them, nothing about the functions (docs/evaluation.md)."""
    rows = []
    for f in _sample([f for f in functions if f.line]):
        name, params = f.line.split("(", 1)
        params, tail = params.rsplit(")", 1)
        wrong = []
        for k in range(3):
            chars = list(params)
            random.Random(zlib.crc32(f"{f.qualname}/{k}".encode())).shuffle(chars)
            wrong.append(f" {name}({''.join(chars)}){tail}")
        gold = _pick(f.qualname, 4)
        choices = wrong[:gold] + [f" {f.line}"] + wrong[gold:]
        if len(set(choices)) == 4:
            rows.append({"context": f"# {f.qualname}\ndef", "choices": choices, "gold": gold})
    return Task("stdlib_def", "choice", rows)


def make(name: str) -> Task:
    functions = stdlib_functions()
    if name == "stdlib_which":
        return which(functions)
    if name == "stdlib_def":
        return def_line(functions)
    if name == "stdlib_doc_bpb":
        return Task(name, "bpb", [{"text": f.answer} for f in _sample(functions)])
    # stdlib_signature: the rest of a one-line `def` after its name and parenthesis
    rows = [{"prompt": f"# {f.qualname}\ndef {f.line.split('(', 1)[0]}(", "answer": f.line.split("(", 1)[1]}
            for f in _sample([f for f in functions if f.line])]
    return Task(name, "exact", rows)
