"""The built-in verifiable task (rl.prompts empty): small-integer arithmetic, made offline from a
seed. A prompt asks for a + b or a - b with a, b in [0, 20); the answer is the exact result, which
titanlite.rl.rewards:exact_answer checks."""

from __future__ import annotations

import random

TASK_SIZE = 4096
"""Prompts in the built-in set (enough that a debug run does not see one twice often)."""


def arithmetic_rows(n: int = TASK_SIZE, seed: int = 0) -> list[dict]:
    """n rows {"prompt": "7 + 12 =", "answer": "19"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randrange(20), rng.randrange(20), rng.choice("+-")
        rows.append({"prompt": f"{a} {op} {b} =", "answer": str(a + b if op == "+" else a - b)})
    return rows
