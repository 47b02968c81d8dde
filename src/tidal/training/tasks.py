"""A bundled single-turn verifiable task for the GRPO learning benchmark: add two numbers.

In: a seeded RNG. Out: problems (a prompt text, chat messages and the integer answer) and
``reward(completion, answer)``. Only the reward function and prompts live here, so the task can
move under ``tidal.agents`` environments unchanged; rollout (sampling) is the engine's business.

Reward (verifiable, no model judge): 1.0 if the completion starts with the correct number;
0.1 if it starts with a wrong number (the answer format is right); 0.0 otherwise.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_LEADING_INT = re.compile(r"\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    def text(self) -> str:
        """Bare prompt for a model without a chat template."""
        return f"{self.a}+{self.b}="

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": f"What is {self.a}+{self.b}? Reply with the number only."}
        ]


class AdditionTask:
    def __init__(self, max_operand: int = 9, seed: int = 0) -> None:
        self.max_operand = max_operand
        self._rng = random.Random(seed)

    def sample(self, n: int) -> list[Problem]:
        hi = self.max_operand
        return [Problem(self._rng.randint(0, hi), self._rng.randint(0, hi)) for _ in range(n)]


def reward(completion: str, answer: int) -> float:
    m = _LEADING_INT.match(completion)
    if m is None:
        return 0.0
    return 1.0 if int(m.group(1)) == answer else 0.1
