"""The built-in task sources (``task.source.kind: arithmetic | workspace``): a row per group
from the group's seed, the ``step`` the ``chat`` agent kind calls after each answer, and the
reward. They run the road every user task runs (task source -> agent kind -> ``Outcome``):
``TaskConfig.with_builtin_defaults`` fills in ``task.agent.step`` and ``task.reward.function``
with the names below when a config leaves them out, and a config without a ``task:`` section
gets the ``arithmetic`` source.

In: the source config and a group's seed (``row``); per turn the row, the model's answer and the
execution's workspace (``*_step``). Out: a ``TaskRow`` (chat messages, the reference answer, the
files to write into each workspace), a step's ``{observation, done, reward}`` and a reward.

``arithmetic`` (single-turn): "What is a plus b?"; reward 1 if the answer's first integer is the
sum, else 0.

``workspace`` (multi-turn tools). Each workspace gets ``data0.txt``, ``data1.txt`` holding one
number in ``1..9`` each (drawn from the seed); the first message names them. The agent answers
with commands, one per line, at most ``MAX_COMMANDS`` per turn; each waits one tool latency
(lognormal, median ``task.source.tool_latency_s``, sigma 1.5, capped at 5 s; the i-th wait of an
execution is the i-th draw of a stream seeded from the group's seed):

- ``read FILE...``: ``FILE: <content>`` for each file; ``write FILE TEXT``: writes TEXT to a new
  file of the workspace; writing ``answer.txt`` (TEXT must hold an integer) submits the answer
  and ends the task; ``ls``: the file names; ``done``: ends the task.
- Commands are found leniently (a small model rarely writes a clean line): a line may carry
  prose, markdown backticks or a ``$``; its first word ``read`` or ``write`` (any case) starts
  the command, and file names are the following words containing a dot (quotes and
  punctuation around them ignored); ``write`` targets ``answer.txt`` if it is among them (else
  the first file name) and writes the other words (``write 8 to answer.txt`` writes ``8 to``).
  A line is an *exact* command if it is nothing but a well-formed, successful command
  (``read data0.txt``, ``write answer.txt 7``, ``ls``, ``done``). Paths must name a visible file
  directly inside the workspace (``..``, absolute paths, subdirectories and names starting with
  a dot are refused) and data files cannot be overwritten.
- Observations: each command's output; after an invalid command, the command list with the
  real file names; once every data file was read, "Now write their sum to answer.txt.".

Reward (deterministic, from the workspace and the commands the agent ran, so an execution that
timed out is scored as it stands): ``1.0`` if the last integer in ``answer.txt`` is the sum;
otherwise partial credit for verifiable progress, at most 0.5: ``0.1 * exact commands / commands
+ 0.3 * data files read / n_files + 0.1 if answer.txt holds an integer``; 0 with no command.
What an execution did so far is kept in ``.tidal/workspace_task.json`` of its workspace.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tidal.agents.tasks import TaskRow
from tidal.config import TaskSourceConfig
from tidal.seeding import derive_seed

BUILTIN_SOURCES = ("arithmetic", "workspace")
ARITHMETIC_PROMPT = "Answer with the number only."
WORKSPACE_PROMPT = (
    "You are a file agent. Reply with commands only, one per line:\n"
    "read FILE...\nwrite answer.txt NUMBER\n"
    "Example:\nread data0.txt data1.txt"
)
N_FILES, MAX_NUMBER, MAX_COMMANDS = 2, 9, 4
LATENCY_SIGMA, LATENCY_CAP_S = 1.5, 5.0
TOOL_LATENCY_S = 0.2  # the median when task.source.tool_latency_s is not set
STATE = Path(".tidal") / "workspace_task.json"
_NUMBER = re.compile(r"-?\d+")
_COMMAND = re.compile(r"\b(read|write)\b", re.IGNORECASE)
_PUNCT = "`'\".,:;!?()[]{}<>"


def row(source: TaskSourceConfig, seed: int, index: int = 0) -> TaskRow:
    """The row of one group (every execution of it gets the same problem)."""
    if source.kind == "arithmetic":
        return arithmetic_row(seed, index)
    latency_s = source.tool_latency_s
    return workspace_row(seed, index, TOOL_LATENCY_S if latency_s is None else latency_s)


def _chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def arithmetic_row(seed: int, index: int = 0) -> TaskRow:
    rng = random.Random(seed)
    a, b = rng.randrange(0, 100), rng.randrange(0, 100)
    return TaskRow(
        index,
        messages=_chat(ARITHMETIC_PROMPT, f"What is {a} plus {b}?"),
        answer=a + b,
        data_source="arithmetic",
    )


def arithmetic_reward(row: TaskRow, answer: str) -> float:
    found = _NUMBER.findall(answer or "")
    return 1.0 if found and int(found[0]) == row.answer else 0.0


def arithmetic_step(row: TaskRow, answer: str) -> dict[str, Any]:
    """One answer ends the episode, scored at once."""
    return {"observation": "", "done": True, "reward": arithmetic_reward(row, answer)}


def workspace_row(seed: int, index: int = 0, tool_latency_s: float = TOOL_LATENCY_S) -> TaskRow:
    rng = random.Random(seed)
    numbers = [rng.randrange(1, MAX_NUMBER + 1) for _ in range(N_FILES)]
    names = [f"data{i}.txt" for i in range(N_FILES)]
    files = " ".join(names)
    first = (
        f"Files: {files}\nGoal: the sum of their numbers in answer.txt.\n"
        f"First command:\nread {files}"
    )
    return TaskRow(
        index,
        messages=_chat(WORKSPACE_PROMPT, first),
        answer=sum(numbers),
        metadata={
            "workspace_files": {n: f"{x}\n" for n, x in zip(names, numbers, strict=True)},
            "data_files": names,
            "latency_seed": derive_seed("latency", seed),
            "tool_latency_s": tool_latency_s,
        },
        data_source="workspace",
    )


async def workspace_step(row: TaskRow, answer: str, workspace: Path) -> dict[str, Any]:
    """The answer's commands run in the workspace; the score so far is the reward."""
    ep = Episode.load(row, workspace)
    obs, done = await ep.step(answer)
    return {"observation": obs, "done": done, "reward": ep.score()}


def workspace_reward(row: TaskRow, workspace: Path) -> float:
    """The score of what the execution did (also when it timed out or failed)."""
    return Episode.load(row, workspace).score()


@dataclass
class _Counts:
    read_files: list[str] = field(default_factory=list)
    commands: int = 0
    exact_commands: int = 0


class Episode:
    """One execution of the workspace task: its commands, its score; the counts persist in
    the workspace (``STATE``) between the turns' ``step`` calls."""

    def __init__(self, row: TaskRow, workspace: Path, counts: _Counts | None = None) -> None:
        self.row, self.workspace = row, Path(workspace)
        self.data_files: list[str] = list(row.metadata["data_files"])
        self.expected = int(row.answer)
        self.counts = counts or _Counts()

    @classmethod
    def load(cls, row: TaskRow, workspace: Path) -> Episode:
        path = Path(workspace) / STATE
        counts = _Counts(**json.loads(path.read_text())) if path.is_file() else None
        return cls(row, workspace, counts)

    def _save(self) -> None:
        path = self.workspace / STATE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self.counts)))

    def _latency_s(self) -> float:
        """The wait of this execution's next command: that draw of its seeded stream."""
        rng = random.Random(self.row.metadata["latency_seed"])
        for _ in range(self.counts.commands):
            rng.lognormvariate(0.0, LATENCY_SIGMA)
        median_s = float(self.row.metadata["tool_latency_s"])
        return min(LATENCY_CAP_S, median_s * rng.lognormvariate(0.0, LATENCY_SIGMA))

    @property
    def hint(self) -> str:
        return f"Commands: read {' '.join(self.data_files)} | write answer.txt NUMBER"

    async def step(self, action: str) -> tuple[str, bool]:
        """(observation, task ended)."""
        outputs: list[str] = []
        done = invalid = False
        lines = [c for c in (_clean(x) for x in action.splitlines()) if c]
        for line in lines[:MAX_COMMANDS]:
            await asyncio.sleep(self._latency_s())
            out, exact, done = self._run(line)
            self.counts.commands += 1
            self.counts.exact_commands += exact
            self._save()  # a timeout scores what ran so far
            invalid |= not exact
            outputs.append(out)
            if done:
                break
        if not outputs:
            outputs.append("no command")
            invalid = True
        if invalid and not done:
            outputs.append(self.hint)
        elif not done and set(self.counts.read_files).issuperset(self.data_files):
            outputs.append("Now write their sum to answer.txt.")
        return "\n".join(outputs), done

    def _path(self, name: str) -> Path | None:
        ws = self.workspace
        try:  # a sampled name may hold anything, a NUL byte included: then no such file
            path = (ws / name).resolve()
        except (OSError, ValueError):
            return None
        ok = path.parent == ws.resolve() and not path.name.startswith(".")
        return path if ok else None

    def _run(self, line: str) -> tuple[str, bool, bool]:
        """(observation, an exact and successful command, task ended)."""
        ws = self.workspace
        if line in ("ls", "done"):
            if line == "done":
                return "done", True, True
            names = sorted(p.name for p in ws.iterdir() if not p.name.startswith("."))
            return " ".join(names), True, False
        m = _COMMAND.search(line)
        if m is None:
            return f"invalid: {line[:30]}", False, False
        exact = m.start() == 0 and m.group(1) in ("read", "write")
        words = [w.strip(_PUNCT) for w in line[m.end() :].split()]
        if m.group(1).lower() == "read":
            return self._read(line, words, exact)
        dotted = [i for i, w in enumerate(words) if "." in w]
        at = words.index("answer.txt") if "answer.txt" in words else (dotted or [None])[0]
        raw = line[m.end() :].split()
        text = " ".join(raw[:at] + raw[at + 1 :]) if at is not None else ""
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

    def _read(self, line: str, words: list[str], exact: bool) -> tuple[str, bool, bool]:
        names = [w for w in words if "." in w]
        if not names:
            return f"invalid: {line[:30]}", False, False
        outs = []
        for name in names[: N_FILES + 2]:
            path = self._path(name)
            if path is None or not path.is_file():
                outs.append(f"{name[:30]}: no such file")
                exact = False
            else:
                if path.name not in self.counts.read_files:
                    self.counts.read_files.append(path.name)
                outs.append(f"{path.name}: {path.read_text()[:100].strip()}")
        return "\n".join(outs), exact and len(names) == len(words), False

    def score(self) -> float:
        if self.counts.commands == 0:
            return 0.0
        answer = self.workspace / "answer.txt"
        found = _NUMBER.findall(answer.read_text()) if answer.is_file() else []
        if found and int(found[-1]) == self.expected:
            return 1.0
        read = len(set(self.counts.read_files).intersection(self.data_files)) / N_FILES
        return round(
            0.1 * self.counts.exact_commands / self.counts.commands
            + 0.3 * read
            + (0.1 if found else 0.0),
            6,
        )


def _clean(line: str) -> str:
    """Tolerate markdown around a command: surrounding backticks, a leading ``$``."""
    line = line.strip().strip("`").strip()
    return line[1:].strip() if line.startswith("$") else line
