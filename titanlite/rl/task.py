"""The built-in verifiable task (rl.prompts empty): small-integer arithmetic, made offline from a
seed. A prompt asks for a + b (a, b in [0, 5)) or a - b (0 <= b <= a < 10); the answer is one digit,
so that a model that has never seen arithmetic hits it sometimes by chance and GRPO has a signal
from the first steps. titanlite.rl.rewards:exact_answer checks it."""

from __future__ import annotations

import random

TASK_SIZE = 4096
"""Prompts in the built-in set (enough that a debug run does not see one twice often)."""


def arithmetic_rows(n: int = TASK_SIZE, seed: int = 0) -> list[dict]:
    """n rows {"prompt": "3 + 4 =", "answer": "7"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if rng.random() < 0.5:
            a, b = rng.randrange(5), rng.randrange(5)
            rows.append({"prompt": f"{a} + {b} =", "answer": str(a + b)})
        else:
            a = rng.randrange(10)
            b = rng.randrange(a + 1)
            rows.append({"prompt": f"{a} - {b} =", "answer": str(a - b)})
    return rows
