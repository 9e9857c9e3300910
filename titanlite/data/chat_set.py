"""The built-in chat set (data.format chat with an empty data.path): questions about the running
interpreter's public standard-library functions and methods, answered with the first paragraph of their
docstrings, in the order of the embedded text source (files sorted by path). Every choice (the
question's wording, a system message, a second turn asking for the call signature) is a function of
the function's qualified name, so the set is the same on every run of one Python version, and
its held-out tail (data.holdout_fraction), never trained on, is a hashed sample of the functions.

Functions are found by a regular expression rather than by parsing (which takes seconds for the
12 MB): a `def` at the top level or in a top-level public class, whose body opens with a
triple-quoted string.
"""

from __future__ import annotations

import bisect
import inspect
import re
import zlib
from dataclasses import dataclass

from titanlite.data.sources import stdlib_files

SYSTEM = "You answer questions about the Python standard library."
QUESTIONS = ("What does `{}` do?", "Explain `{}`.", "What is `{}` for?", "Tell me about `{}`.")
FOLLOW_UP = "How do I call it?"
_DEF = re.compile(r'^(?P<indent>(?:    )?)def (?P<name>[A-Za-z]\w*)\((?P<args>[^()]*(?:\([^()]*\)[^()]*)*)\)'
                  r'(?:[ \t]*->[^:\n]+)?:[ \t]*\n[ \t]+[rR]?(?P<q>"""|\'\'\')(?P<doc>.*?)(?P=q)', re.M | re.S)
_TOP = re.compile(r"^(?:class (?P<cls>[A-Za-z]\w*)|[^\s#@])", re.M)  # a line at the top level


def _answer(name: str, doc: str) -> str:
    """The docstring's first paragraph on one line (its second where the first is a signature),
    up to any example (>>>)."""
    paragraphs = [" ".join(p.split(">>>")[0].split()) for p in inspect.cleandoc(doc).split("\n\n")]
    paragraphs = [p for p in paragraphs if p]
    if paragraphs and paragraphs[0].startswith(f"{name}(") and len(paragraphs) > 1:
        paragraphs = paragraphs[1:]
    return paragraphs[0] if paragraphs else ""


def _module(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _chat(qualname: str, params: str, answer: str) -> list[dict]:
    pick = zlib.crc32(qualname.encode())
    chat = [{"role": "system", "content": SYSTEM}] if pick % 2 else []
    chat += [{"role": "user", "content": QUESTIONS[pick // 2 % len(QUESTIONS)].format(qualname)},
             {"role": "assistant", "content": answer}]
    if params and pick % 3 == 0:
        chat += [{"role": "user", "content": FOLLOW_UP}, {"role": "assistant", "content": f"`{qualname}({params})`"}]
    return chat


@dataclass(frozen=True)
class StdlibFunction:
    """A public standard-library function or method with a docstring, as the source writes it."""

    qualname: str
    params: str
    """Its parameters on one line (a method's self or cls left out)."""
    answer: str
    """The docstring's first paragraph on one line (_answer)."""
    line: str
    """Its `def` line from the name on (`dumps(obj, *, skipkeys=False, ...):`), "" where the
    signature spans lines."""


def stdlib_functions() -> list[StdlibFunction]:
    """Every function of the set, in the order of the embedded source: what the chat set asks
    about and what the built-in evaluation tasks (titanlite.eval.builtin) are made of."""
    out = []
    for path, text in stdlib_files():
        module = _module(path)
        if any(part.startswith("_") for part in module.split(".")):
            continue  # private modules
        tops = [(m.start(), m.group("cls")) for m in _TOP.finditer(text)]
        starts = [s for s, _ in tops]
        for m in _DEF.finditer(text):
            owner = ""
            if m.group("indent"):  # a method: the top-level line before it must open a public class
                i = bisect.bisect_left(starts, m.start()) - 1
                if i < 0 or not tops[i][1] or tops[i][1].startswith("_"):
                    continue
                owner = tops[i][1] + "."
            answer = _answer(m.group("name"), m.group("doc"))
            if len(answer) < 10:
                continue
            params = [p for p in " ".join(m.group("args").split()).rstrip(", ").split(", ") if p]
            if owner and params and params[0] in ("self", "cls"):
                params = params[1:]
            head = text[m.start("name"):text.index("\n", m.start("name"))]
            out.append(StdlibFunction(f"{module}.{owner}{m.group('name')}", ", ".join(params), answer,
                                      head if head.endswith(":") else ""))
    return out


def stdlib_chats() -> list[tuple[str, list[dict]]]:
    """(where, messages) of every chat of the set, ordered by a hash of the answer, so that its
    held-out tail (data.holdout_fraction) is a sample of every module's functions, and functions
    that share a docstring (a method and its overrides) fall on the same side. (In the source's
    order the tail was the last modules', wsgiref to zipimport: what was learnt on the others was
    measured on modules unlike any trained on.)"""
    functions = sorted(stdlib_functions(), key=lambda f: (zlib.crc32(f.answer.encode()), f.answer))
    return [(f"the built-in chat set, {f.qualname}", _chat(f.qualname, f.params, f.answer)) for f in functions]
