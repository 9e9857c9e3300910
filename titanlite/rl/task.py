"""The built-in verifiable task (rl.prompts empty): small-integer arithmetic, made offline from a
seed. A prompt asks for a + b or a - b whose operands and result are in [0, ANSWERS). Each row
first draws its answer uniformly, then one of the questions with that answer, so that no answer is
commoner than another: a policy that ignores the question and always gives one digit earns
1 / ANSWERS, and a mean reward above that means the model reads the question.

ANSWERS is 2 (six questions: 0 + 0, 0 + 1, 1 + 0, 0 - 0, 1 - 0, 1 - 1) because GRPO learns only
what it samples: the debug walk-through's model, trained on Python source and chats, puts 4-6% of
its first token after "3 + 1 =" on "0" and 2% on "1", but 0.1-0.3% on each of "2" to "4", so
groups of 8 completions almost never hold a right answer above 1 and get no advantage to learn
from (docs/post_training.md). titanlite.rl.rewards:exact_answer checks it."""

from __future__ import annotations

import random

TASK_SIZE = 4096
"""Prompts in the built-in set (enough that a debug run does not see one twice often)."""
ANSWERS = 2
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
    """n rows {"prompt": "1 - 0 =", "answer": "1"}, each answer equally likely."""
    rng, by_answer = random.Random(seed), questions()
    rows = []
    for _ in range(n):
        c = rng.randrange(ANSWERS)
        rows.append({"prompt": rng.choice(by_answer[c]), "answer": str(c)})
    return rows
