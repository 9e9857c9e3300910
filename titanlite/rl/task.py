"""The built-in verifiable task (rl.prompts empty): small-integer arithmetic, made offline from a
seed. A prompt asks for a + b or a - b (operands in [0, 5)) whose result is a digit in [0, 5): 30
distinct questions. Each row first draws its answer uniformly, then one of the questions with that
answer, so that no answer is commoner than another: a policy that ignores the question and always
gives one digit earns 0.2, and a mean reward above that means the model reads the question. A
model that has never seen arithmetic hits the answer sometimes by chance, so GRPO has a signal
from the first steps. titanlite.rl.rewards:exact_answer checks it."""

from __future__ import annotations

import random

TASK_SIZE = 4096
"""Prompts in the built-in set (enough that a debug run does not see one twice often)."""
ANSWERS = 5
"""Results (and operands) are in [0, ANSWERS)."""


def questions() -> dict[int, list[str]]:
    """Each result's questions, in a fixed order."""
    out: dict[int, list[str]] = {c: [] for c in range(ANSWERS)}
    for a in range(ANSWERS):
        for b in range(ANSWERS):
            if a + b < ANSWERS:
                out[a + b].append(f"{a} + {b} =")
            if b <= a:
                out[a - b].append(f"{a} - {b} =")
    return out


def arithmetic_rows(n: int = TASK_SIZE, seed: int = 0) -> list[dict]:
    """n rows {"prompt": "3 + 1 =", "answer": "4"}, each answer equally likely."""
    rng, by_answer = random.Random(seed), questions()
    rows = []
    for _ in range(n):
        c = rng.randrange(ANSWERS)
        rows.append({"prompt": rng.choice(by_answer[c]), "answer": str(c)})
    return rows
