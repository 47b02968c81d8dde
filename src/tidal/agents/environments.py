"""The environment protocol and the two bundled environments.

In: a workspace directory (``reset``) and the model's text actions (``step``). Out:
observations, rewards and ``done``. Tool calls take real time (an injected, seeded latency
distribution), and ``score`` grades what an execution produced so far (timeouts are scored too).

- ``WorkspaceTask`` (multi-turn): files in the workspace hold numbers; the agent must ``ls``,
  ``read`` them and ``write answer.txt`` with their sum. Commands are one per line:
  ``ls`` | ``read FILE`` | ``write FILE TEXT`` | ``done``. Long-tailed tool latencies.
- ``ArithmeticTask`` (single-turn): "What is a plus b?"; reward 1 if the answer has the sum.
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_NUMBER = re.compile(r"-?\d+")


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool


class Environment(Protocol):
    system_prompt: str

    async def reset(self, workspace: Path) -> str: ...
    async def step(self, action: str) -> StepResult: ...
    def score(self) -> float: ...


class ToolLatency:
    """Lognormal tool latency (median ``median_s``), capped; seeded for reproducibility."""

    def __init__(self, rng: random.Random, median_s: float = 0.3, sigma: float = 1.5,
                 cap_s: float = 5.0) -> None:
        self.rng, self.median_s, self.sigma, self.cap_s = rng, median_s, sigma, cap_s

    async def wait(self) -> float:
        delay = min(self.cap_s, self.median_s * self.rng.lognormvariate(0.0, self.sigma))
        await asyncio.sleep(delay)
        return delay


class WorkspaceTask:
    system_prompt = ("You work in a directory. Reply with one command per line: ls | read FILE |"
                     " write FILE TEXT | done. Write the sum of the numbers in the files into"
                     " answer.txt, then say done.")

    def __init__(self, seed: int, latency: ToolLatency | None = None, n_files: int = 2) -> None:
        self.rng = random.Random(seed)
        self.latency = latency or ToolLatency(random.Random(seed + 1))
        self.n_files = n_files
        self.workspace: Path | None = None
        self.expected = 0

    async def reset(self, workspace: Path) -> str:
        self.workspace = workspace
        workspace.mkdir(parents=True, exist_ok=True)
        numbers = [self.rng.randrange(1, 50) for _ in range(self.n_files)]
        for i, n in enumerate(numbers):
            (workspace / f"data{i}.txt").write_text(f"{n}\n")
        self.expected = sum(numbers)
        return f"Task: add the numbers in the files and write the sum to answer.txt. " \
               f"Files: {', '.join(sorted(p.name for p in workspace.iterdir()))}"

    async def step(self, action: str) -> StepResult:
        assert self.workspace is not None, "reset first"
        outputs = []
        done = False
        for line in [x.strip() for x in action.strip().splitlines() if x.strip()][:4]:
            await self.latency.wait()
            outputs.append(self._run(line))
            if line.lower().startswith("done"):
                done = True
                break
        if not outputs:
            outputs.append("no command; use ls, read FILE, write FILE TEXT or done")
        return StepResult("\n".join(outputs), self.score() if done else 0.0, done)

    def _run(self, line: str) -> str:
        parts = line.split(maxsplit=2)
        cmd = parts[0].lower()
        ws = self.workspace
        assert ws is not None
        if cmd == "ls":
            return " ".join(sorted(p.name for p in ws.iterdir()))
        if cmd == "read" and len(parts) >= 2:
            path = (ws / parts[1]).resolve()
            if path.parent != ws.resolve() or not path.is_file():
                return f"read: {parts[1]}: no such file"
            return path.read_text()[:2000]
        if cmd == "write" and len(parts) == 3:
            path = (ws / parts[1]).resolve()
            if path.parent != ws.resolve():
                return "write: only files in the workspace"
            path.write_text(parts[2] + "\n")
            return f"wrote {len(parts[2])} characters to {parts[1]}"
        if cmd == "done":
            return "done"
        return f"unknown command: {line[:60]}"

    def score(self) -> float:
        answer = self.workspace / "answer.txt" if self.workspace else None
        if answer is None or not answer.is_file():
            return 0.0
        found = _NUMBER.findall(answer.read_text())
        return 1.0 if found and int(found[0]) == self.expected else 0.2


class ArithmeticTask:
    system_prompt = "Answer with the number only."

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.a, self.b = rng.randrange(0, 100), rng.randrange(0, 100)
        self.answer: str | None = None

    async def reset(self, workspace: Path) -> str:
        return f"What is {self.a} plus {self.b}?"

    async def step(self, action: str) -> StepResult:
        self.answer = action
        return StepResult("", self.score(), True)

    def score(self) -> float:
        found = _NUMBER.findall(self.answer or "")
        return 1.0 if found and int(found[0]) == self.a + self.b else 0.0
