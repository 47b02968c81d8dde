"""The ``python`` agent kind: the user's async function runs each execution, given an
``openai.AsyncOpenAI`` client already bound to it (its base URL and key name the execution at
the proxy), the task row and the workspace.

In: ``task.agent.function`` (``module:function`` or ``file.py:function``, an ``async def``) that
takes any of ``client``, ``row``, ``workspace``, ``model``, ``ctx`` by name. Out: an
``Outcome``: the function may return a number (the reward), None (the run's reward function
scores the execution), a string (the final answer, scored by the reward function), a dict
``{reward, answer, transcript}`` or an ``Outcome`` (``tidal.contracts.executions``). The client
does not retry (the proxy already carries a call across engine moves; a failed call is the
agent's to see).
"""

from __future__ import annotations

import inspect
from numbers import Real

from tidal.agents.callables import load_callable, parameters
from tidal.agents.kinds import AgentContext, register_agent_kind, unused
from tidal.config import AgentConfig
from tidal.contracts.executions import Outcome, Turn
from tidal.errors import ConfigError

_GIVEN = ("client", "row", "workspace", "model", "ctx")


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
        unknown = [n for n in names if n not in (*_GIVEN, "**")]
        if unknown:
            raise ConfigError(
                f"{field}.function",
                f"{spec.function}: parameter {unknown[0]!r} is none of {', '.join(_GIVEN)}",
            )
        self.names = list(_GIVEN) if "**" in names else names
        self.field = field

    async def run(self, ctx: AgentContext) -> Outcome:
        import openai

        async with openai.AsyncOpenAI(
            base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=ctx.timeout_s
        ) as client:
            given = {
                "client": client,
                "row": ctx.row,
                "workspace": ctx.workspace,
                "model": ctx.model,
                "ctx": ctx,
            }
            return outcome_of(await self.fn(**{n: given[n] for n in self.names}))


def outcome_of(res: object) -> Outcome:
    """A python agent's return value as an ``Outcome`` (``TypeError`` if it is none of the
    accepted shapes; a transcript's turns are ``Turn``s or their dicts)."""
    if isinstance(res, Outcome):
        return res
    if res is None:
        return Outcome()
    if isinstance(res, bool) or not isinstance(res, Real | str | dict):
        raise TypeError(
            f"the agent returned {type(res).__name__}: expected a number, None, "
            "a str, a dict {reward, answer} or an Outcome"
        )
    if isinstance(res, Real):
        return Outcome(reward=float(res))
    if isinstance(res, str):
        return Outcome(answer=res)
    reward = res.get("reward")
    return Outcome(
        reward=None if reward is None else float(reward),
        answer=str(res.get("answer", "")),
        transcript=[Turn.model_validate(t) for t in res.get("transcript", [])],
    )


register_agent_kind("python", PythonKind)
