"""The environment protocol and the two bundled environments.

In: a workspace directory (``reset``) and the model's text actions (``step``). Out:
observations, rewards and ``done``. Tool calls take real time (an injected, seeded latency
distribution), and ``score`` grades what an execution produced so far (timeouts are scored too).

``WorkspaceTask`` (multi-turn). ``reset`` writes ``n_files`` read-only files ``data0.txt``, ...
each holding one number in ``1..max_number`` (drawn from the seed), and names them. The agent
answers with commands, one per line, at most ``max_commands`` per turn; each command waits one
tool latency (``ToolLatency``: lognormal, long-tailed, seeded):

- ``read FILE...``: ``FILE: <content>`` for each file; ``write FILE TEXT``: writes TEXT to a new
  file of the workspace; writing ``answer.txt`` (TEXT must hold an integer) submits the answer
  and ends the task;
  ``ls``: the file names; ``done``: ends the task. The first observation names the files, the
  task and the first command to type.
- Commands are found leniently (a small model rarely writes a clean line): a line may carry
  prose, markdown backticks or a ``$``; its first word ``read`` or ``write`` (any case) starts
  the command, and file names are the following words containing a dot (quotes and
  punctuation around them ignored); ``write`` targets ``answer.txt`` if it is among them (else
  the first file name) and writes the other words (``write 8 to answer.txt`` writes ``8 to``).
  A line is an *exact* command if it is nothing but a well-formed, successful command
  (``read data0.txt``, ``write answer.txt 7``, ``ls``, ``done``). Paths must name a file
  directly inside the workspace (``..``, absolute paths and subdirectories are refused) and
  data files cannot be overwritten.
- Observations: each command's output; after an invalid command, the command list with the
  real file names; once every data file was read, "Now write their sum to answer.txt.".

Reward (``score``; deterministic, computed from the workspace and the commands the agent ran,
also for executions that time out): ``1.0`` if the last integer in ``answer.txt`` is the sum of
the data files' numbers (``3 + 5 = 8`` counts); otherwise partial credit for verifiable
progress, at most 0.5: ``0.1 * exact commands / commands + 0.3 * data files read / n_files +
0.1 if answer.txt holds an integer``. An execution that sent no command line scores 0.

``ArithmeticTask`` (single-turn): "What is a plus b?"; reward 1 if the answer has the sum.
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
    system_prompt = ("You are a file agent. Reply with commands only, one per line:\n"
                     "read FILE...\nwrite answer.txt NUMBER\n"
                     "Example:\nread data0.txt data1.txt")

    def __init__(self, seed: int, latency: ToolLatency | None = None, n_files: int = 2,
                 max_number: int = 9, max_commands: int = 4,
                 latency_median_s: float = 0.3) -> None:
        self.rng = random.Random(seed)
        self.latency = latency or ToolLatency(random.Random(seed + 1), median_s=latency_median_s)
        self.n_files, self.max_number, self.max_commands = n_files, max_number, max_commands
        self.workspace: Path | None = None
        self.expected = 0
        self.data_files: list[str] = []
        self.read_files: set[str] = set()
        self.commands = 0
        self.exact_commands = 0

    @property
    def hint(self) -> str:
        return f"Commands: read {' '.join(self.data_files)} | write answer.txt NUMBER"

    async def reset(self, workspace: Path) -> str:
        self.workspace = workspace
        workspace.mkdir(parents=True, exist_ok=True)
        numbers = [self.rng.randrange(1, self.max_number + 1) for _ in range(self.n_files)]
        self.data_files = [f"data{i}.txt" for i in range(self.n_files)]
        for name, n in zip(self.data_files, numbers, strict=True):
            (workspace / name).write_text(f"{n}\n")
        self.expected = sum(numbers)
        files = " ".join(self.data_files)
        return (f"Files: {files}\nGoal: the sum of their numbers in answer.txt.\n"
                f"First command:\nread {files}")

    async def step(self, action: str) -> StepResult:
        assert self.workspace is not None, "reset first"
        outputs = []
        done = invalid = False
        lines = [c for c in (_clean(x) for x in action.splitlines()) if c]
        for line in lines[: self.max_commands]:
            await self.latency.wait()
            out, exact, done = self._run(line)
            self.commands += 1
            self.exact_commands += exact
            invalid |= not exact
            outputs.append(out)
            if done:
                break
        if not outputs:
            outputs.append("no command")
            invalid = True
        if invalid and not done:
            outputs.append(self.hint)
        elif not done and self.read_files.issuperset(self.data_files):
            outputs.append("Now write their sum to answer.txt.")
        return StepResult("\n".join(outputs), self.score() if done else 0.0, done)

    def _path(self, name: str) -> Path | None:
        ws = self.workspace
        assert ws is not None
        try:  # a sampled name may hold anything, a NUL byte included: then no such file
            path = (ws / name).resolve()
            return path if path.parent == ws.resolve() else None
        except (OSError, ValueError):
            return None

    def _run(self, line: str) -> tuple[str, bool, bool]:
        """(observation, an exact and successful command, task ended)."""
        ws = self.workspace
        assert ws is not None
        if line in ("ls", "done"):
            if line == "done":
                return "done", True, True
            return " ".join(sorted(p.name for p in ws.iterdir())), True, False
        m = _COMMAND.search(line)
        if m is None:
            return f"invalid: {line[:30]}", False, False
        exact = m.start() == 0 and m.group(1) in ("read", "write")
        words = [w.strip(_PUNCT) for w in line[m.end():].split()]
        if m.group(1).lower() == "read":
            names = [w for w in words if "." in w]
            if not names:
                return f"invalid: {line[:30]}", False, False
            outs = []
            for name in names[: self.n_files + 2]:
                path = self._path(name)
                if path is None or not path.is_file():
                    outs.append(f"{name[:30]}: no such file")
                    exact = False
                else:
                    self.read_files.add(path.name)
                    outs.append(f"{path.name}: {path.read_text()[:100].strip()}")
            return "\n".join(outs), exact and len(names) == len(words), False
        dotted = [i for i, w in enumerate(words) if "." in w]
        at = words.index("answer.txt") if "answer.txt" in words else (dotted or [None])[0]
        raw = line[m.end():].split()
        text = " ".join(raw[:at] + raw[at + 1:]) if at is not None else ""
        if at is None or not text:
            return f"invalid: {line[:30]}", False, False
        path = self._path(words[at])
        if path is None or path.name in self.data_files:
            return "write: only new files in this folder", False, False
        if path.name == "answer.txt" and not _NUMBER.search(text):
            return "write: answer.txt needs a NUMBER", False, False
        path.write_text(text + "\n")
        if path.name == "answer.txt":
            return "answer submitted", exact and at == 0, True
        return f"wrote {path.name}", exact and at == 0, False

    def score(self) -> float:
        if self.workspace is None or self.commands == 0:
            return 0.0
        answer = self.workspace / "answer.txt"
        found = _NUMBER.findall(answer.read_text()) if answer.is_file() else []
        if found and int(found[-1]) == self.expected:
            return 1.0
        read = len(self.read_files.intersection(self.data_files)) / self.n_files
        return round(0.1 * self.exact_commands / self.commands + 0.3 * read
                     + (0.1 if found else 0.0), 6)


_COMMAND = re.compile(r"\b(read|write)\b", re.IGNORECASE)
_PUNCT = "`'\".,:;!?()[]{}<>"


def _clean(line: str) -> str:
    """Tolerate markdown around a command: surrounding backticks, a leading ``$``."""
    line = line.strip().strip("`").strip()
    return line[1:].strip() if line.startswith("$") else line


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
