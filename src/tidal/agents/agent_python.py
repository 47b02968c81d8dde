"""The ``python`` agent kind: the user's async function runs each execution, given an
``openai.AsyncOpenAI`` client already bound to it (its base URL and key name the execution at
the proxy), the task row and the workspace.

In: ``task.agent.function`` (``module:function`` or ``file.py:function``, an ``async def``) that
takes any of ``client``, ``row``, ``workspace``, ``model``, ``ctx`` by name. Out: an
``Outcome``: the function may return a number (the reward), None (the run's reward function
scores the execution), a string (the final answer, scored by the reward function), a dict
``{reward, answer}`` or an ``Outcome``; a reward that is not finite (NaN, an infinity) or
a bool closes the execution ``reward_error`` with no reward (``finite_reward``). The client does not
retry (the proxy already carries a call across engine moves; a failed call is the agent's to
see).

Kept: the function never runs in the driver's event loop: each call runs in a worker process
(``tidal.agents.python_workers``, ``task.agent.workers`` of them) on the worker's own loop, and
is killed with its worker when it outlives the execution's timeout (an agent that swallows
cancellation or blocks with ``time.sleep`` holds neither the driver nor the run).
"""

from __future__ import annotations

import inspect
from numbers import Real

from tidal.agents.callables import load_callable, parameters
from tidal.agents.kinds import AgentContext, register_agent_kind, unused
from tidal.agents.python_workers import pool
from tidal.config import AgentConfig
from tidal.contracts.close import CloseReason
from tidal.contracts.executions import Outcome, Turn, finite_reward
from tidal.errors import ConfigError

GIVEN = ("client", "row", "workspace", "model", "ctx")


class PythonKind:
    def __init__(self, spec: AgentConfig, field: str = "task.agent") -> None:
        unused(spec, field, "step", "command", "env")
        if not spec.function:
            raise ConfigError(
                f"{field}.function",
                "the 'python' agent kind needs 'module:function' (an async function)",
            )
        self.fn = load_callable(spec.function, f"{field}.function")
        if not inspect.iscoroutinefunction(self.fn):
            raise ConfigError(
                f"{field}.function", f"{spec.function}: must be an async function (async def)"
            )
        names = parameters(self.fn)
        unknown = [n for n in names if n not in (*GIVEN, "**")]
        if unknown:
            raise ConfigError(
                f"{field}.function",
                f"{spec.function}: parameter {unknown[0]!r} is none of {', '.join(GIVEN)}",
            )
        self.names = list(GIVEN) if "**" in names else names
        self.field, self.spec, self.workers = field, spec.function, spec.workers

    async def run(self, ctx: AgentContext) -> Outcome:
        """The function's outcome, from a worker process (``WorkerError`` if it raised or its
        worker was killed; ``TimeoutError`` past ``ctx.timeout_s``)."""
        done = await pool(self.workers).call(
            "agent", {"fn": self.spec, "names": self.names, "ctx": ctx}, ctx.timeout_s
        )
        if not isinstance(done, dict):
            raise TypeError(f"the agent's worker answered {type(done).__name__}")
        return Outcome.model_validate(done)  # checked: a worker is not trusted


def outcome_dict(res: object) -> dict:
    """A python agent's return value as the ``Outcome`` (its JSON dict) its worker sends back
    (in the worker)."""
    return outcome_of(res).model_dump(mode="json")


def _turn(entry: object) -> Turn:
    """A transcript entry (a ``Turn``, a dict or a bare action) as a ``Turn``; timings that are
    not non-negative numbers are left out."""
    if isinstance(entry, Turn):
        return entry
    given = entry if isinstance(entry, dict) else {"action": entry}
    turn = {
        "action": str(given.get("action", "")),
        "observation": str(given.get("observation", "")),
    }
    for key in ("t_call", "call_s", "tool_s"):
        value = given.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            turn[key] = float(value)
    return Turn(**turn)


def outcome_of(res: object) -> Outcome:
    """A python agent's return value as an ``Outcome`` (``TypeError`` if it is none of the
    accepted shapes). A reward that is not finite, or a bool, closes it ``reward_error`` with
    no reward and the why in ``detail``."""
    if isinstance(res, Outcome):
        return res
    if res is None:
        return Outcome()
    if not isinstance(res, Real | str | dict):
        raise TypeError(
            f"the agent returned {type(res).__name__}: expected a number, None, "
            "a str, a dict {reward, answer} or an Outcome"
        )
    if isinstance(res, str):
        return Outcome(answer=res)
    if isinstance(res, dict):
        reward, answer = res.get("reward"), str(res.get("answer", ""))
        turns = [_turn(t) for t in res.get("transcript", [])]
    else:  # a number (a bool too: refused by finite_reward)
        reward, answer, turns = res, "", []
    if reward is None:
        return Outcome(answer=answer, transcript=turns)
    try:
        return Outcome(reward=finite_reward(reward), answer=answer, transcript=turns)
    except ValueError as exc:
        return Outcome(
            reason=CloseReason.REWARD_ERROR,
            answer=answer,
            transcript=turns,
            detail=f"the agent returned a {exc}",
        )


register_agent_kind("python", PythonKind)
