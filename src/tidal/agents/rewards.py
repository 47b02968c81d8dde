"""Rewards from the user's code or a library scorer, computed once per closed execution.

In: ``task.reward`` (a ``module:function`` / ``file.py:function``, or a builtin) and, per
execution, its task row, its ``Outcome`` and its workspace. Out: a float, or a
``RewardError`` (one line: the exception's type and line, or the non-number returned) that closes
the execution with reason ``reward_error``: a reward that fails is never a silent 0.

A user function is called in one of two styles, told apart by its parameter names:
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, as it is (a verl
  user's reward file works unchanged; a dict answer gives its ``score``, as in verl);
- tidal's: any of ``row``, ``answer``, ``workspace``, ``transcript``, ``outcome`` by name.
Each runs in a worker process (``tidal.agents.python_workers``), never in the driver: one that
does not return within ``timeout_s`` is killed with its worker (``reward_error``), and no thread
of the driver waits on it (SIGTERM still ends the run).
Builtins: ``reasoning_gym`` (the dataset's own ``score_answer``, on the ``<answer>`` tag when the
text has one), ``math_verify`` (math-verify's parse + verify against the reference), ``tests``
(the workspace's tests: 1 if they pass, else 0) and ``exact``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
from numbers import Real
from pathlib import Path

from tidal.agents.callables import load_callable, parameters
from tidal.agents.python_workers import WorkerError, pool
from tidal.agents.sandbox import environment, interpreter_paths, sandbox_for
from tidal.agents.tasks import TaskRow
from tidal.config import RewardConfig
from tidal.contracts.executions import Outcome
from tidal.errors import ConfigError, TidalError

VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
TIDAL = ("row", "answer", "workspace", "transcript", "outcome")


class RewardError(TidalError):
    """A reward function raised or returned a non-number."""


class Reward:
    def __init__(self, cfg: RewardConfig, field: str = "task.reward") -> None:
        self.cfg, self.field = cfg, field
        self.style, self.names, self.fn = "builtin", [], None
        if cfg.function is not None:
            self.fn = load_callable(cfg.function, f"{field}.function")
            names = parameters(self.fn)
            if "solution_str" in names:
                self.style, self.names = "verl", [n for n in VERL if n in names or "**" in names]
            else:
                bad = [n for n in names if n not in (*TIDAL, "**")]
                if bad:
                    raise ConfigError(
                        f"{field}.function",
                        f"{cfg.function}: parameter "
                        f"{bad[0]!r} is neither verl's ({', '.join(VERL)}) nor "
                        f"tidal's ({', '.join(TIDAL)})",
                    )
                self.style, self.names = "tidal", list(TIDAL) if "**" in names else names
        elif cfg.builtin == "math_verify":
            import math_verify  # noqa: F401 - an absent extra fails here, before the run

            logging.getLogger("math_verify").setLevel(logging.ERROR)
        elif cfg.builtin == "reasoning_gym":
            import reasoning_gym  # noqa: F401

    async def score(self, row: TaskRow, outcome: Outcome, workspace: Path) -> float:
        """The execution's reward, or ``RewardError``."""
        try:
            value = await asyncio.wait_for(self._call(row, outcome, workspace), self.cfg.timeout_s)
        except TimeoutError:
            raise RewardError(
                f"no reward within {self.cfg.timeout_s:g} s (task.reward.timeout_s)"
            ) from None
        except RewardError:
            raise
        except Exception as exc:  # the user's code may raise anything
            raise RewardError(f"{type(exc).__name__}: {_line(exc)}{_where(exc)}") from None
        return number(value)

    async def _call(self, row: TaskRow, outcome: Outcome, workspace: Path) -> object:
        if self.fn is not None:
            given = (
                {
                    "data_source": row.data_source,
                    "solution_str": outcome.answer,
                    "ground_truth": row.answer,
                    "extra_info": row.metadata,
                }
                if self.style == "verl"
                else {
                    "row": row,
                    "answer": outcome.answer,
                    "workspace": workspace,
                    "transcript": outcome.transcript,
                    "outcome": outcome,
                }
            )
            kwargs = {n: given[n] for n in self.names}
            return await self._in_worker("reward", {"fn": self.cfg.function, "kwargs": kwargs})
        if self.cfg.builtin == "tests":
            return await run_tests(row, workspace, self.cfg.timeout_s)
        return await self._in_worker(
            "builtin", {"name": self.cfg.builtin, "row": row, "answer": outcome.answer}
        )

    async def _in_worker(self, op: str, payload: dict) -> object:
        """The scorer's value, computed in a worker process killed at ``timeout_s``."""
        try:
            return await pool().call(op, payload, self.cfg.timeout_s)
        except WorkerError as exc:
            raise RewardError(str(exc)) from None


def number(value: object) -> float:
    """A reward value as a finite float (verl's dict answers give their ``score``)."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if not isinstance(value, Real):
        raise RewardError(f"returned {type(value).__name__} {str(value)[:60]!r}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise RewardError(f"returned {out}, not a finite number")
    return out


def _reasoning_gym(row: TaskRow, answer: str) -> float:
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    entry = row.metadata.get("entry")
    if entry is None:
        raise RewardError("the 'reasoning_gym' reward needs a reasoning_gym task source")
    given = extract_answer(answer) if "<answer>" in answer else answer.strip()
    fn = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
    return fn(given, entry)


def _math_verify(row: TaskRow, answer: str) -> float:
    import math_verify

    # its own timeouts use SIGALRM, which only the main thread has: bounded by timeout_s here
    gold = math_verify.parse(str(row.answer), parsing_timeout=None)
    pred = math_verify.parse(answer, parsing_timeout=None)
    return 1.0 if math_verify.verify(gold, pred, timeout_seconds=None) else 0.0


def _exact(row: TaskRow, answer: str) -> float:
    return 1.0 if answer.strip() == str(row.answer).strip() else 0.0


_BUILTINS = {"reasoning_gym": _reasoning_gym, "math_verify": _math_verify, "exact": _exact}


async def run_tests(row: TaskRow, workspace: Path, timeout_s: float) -> float:
    """1.0 if the row's test command (default ``python -m pytest -q``) exits 0 in the
    workspace, else 0.0; run in the agents' sandbox (the tests are the agent's work: as root
    they run as the agent's user, ``tidal.agents.sandbox``), killed at ``timeout_s`` with
    everything they started."""
    argv = row.metadata.get("test_command") or [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
    ]
    box = sandbox_for("auto")
    box.prepare(workspace)
    proc = await asyncio.create_subprocess_exec(
        *box.argv(list(argv), workspace, interpreter_paths()),
        cwd=workspace,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
        env={**environment(), "PYTHONDONTWRITEBYTECODE": "1"},
    )
    try:
        code = await asyncio.wait_for(proc.wait(), timeout_s)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)  # and with its namespace, all it started
            await proc.wait()
    return 1.0 if code == 0 else 0.0


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"


def _where(exc: BaseException) -> str:
    """`` at file:line`` of the innermost frame that raised."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    return f" (at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})"
