"""Verifiable rewards: functions f(prompt, completion, row) -> a number, named in the config as
rl.reward = "module:function". `row` is the prompt's row (its "answer" among others)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from titanlite.errors import ConfigError

Reward = Callable[[str, str, dict], float]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"answer:\s*(\S.*?)\s*$", re.IGNORECASE)


def final_answer(completion: str) -> str:
    """What a completion answers: its last number where it has one, else its last non-empty line."""
    numbers = _NUMBER.findall(completion)
    if numbers:
        return numbers[-1]
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def exact_answer(prompt: str, completion: str, row: dict) -> float:
    """1.0 where the completion's final answer is the row's "answer" exactly, else 0.0."""
    return float(final_answer(completion) == str(row.get("answer", "")).strip())


def format_answer(prompt: str, completion: str, row: dict) -> float:
    """1.0 where the completion ends in a line "answer: <something>", else 0.0 (a format check)."""
    return float(bool(_ANSWER.search(completion.strip())))


def load_reward(spec: str) -> Reward:
    """The function rl.reward names, or one line saying why it cannot be had."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"rl.reward: cannot import module '{module}' ({e}); name an importable module "
                          "(on PYTHONPATH) as 'module:function'") from None
    except AttributeError:
        raise ConfigError(f"rl.reward: module '{module}' has no '{name}'; name a function it defines") from None
    if not callable(fn):
        raise ConfigError(f"rl.reward: '{spec}' is a {type(fn).__name__}, not callable; name a function "
                          "f(prompt, completion, row) -> number")
    return fn
