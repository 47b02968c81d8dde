"""The ``python`` agent kind: the user's async function runs each execution, given an
``openai.AsyncOpenAI`` client already bound to it (its base URL and key name the execution at
the proxy), the task row and the workspace.

In: ``task.agent.function`` (``module:function`` or ``file.py:function``, an ``async def``) that
takes any of ``client``, ``row``, ``workspace``, ``model``, ``ctx`` by name. Out: an
``AgentOutcome``: the function may return a number (the reward), None (the run's reward function
scores the execution), a string (the final answer, scored by the reward function), a dict
``{reward, answer}`` or an ``AgentOutcome``; a reward that is NaN, an infinity or a bool
closes the execution ``reward_error`` (no reward, never a stand-in). The client does not retry
(the proxy already carries a call across engine moves; a failed call is the agent's to see).
"""

from __future__ import annotations

import inspect
from numbers import Real

from tidal.agents.callables import load_callable, parameters
from tidal.agents.kinds import AgentContext, AgentOutcome, register_agent_kind, unused
from tidal.config import AgentConfig
from tidal.contracts.executions import finite_reward
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

    async def run(self, ctx: AgentContext) -> AgentOutcome:
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


def outcome_of(res: object) -> AgentOutcome:
    """A python agent's return value as an ``AgentOutcome`` (``TypeError`` if it is none of
    the accepted shapes)."""
    if isinstance(res, AgentOutcome):
        return _checked(res)
    if res is None:
        return AgentOutcome()
    if not isinstance(res, Real | str | dict):
        raise TypeError(
            f"the agent returned {type(res).__name__}: expected a number, None, "
            "a str, a dict {reward, answer} or an AgentOutcome"
        )
    if isinstance(res, Real):  # a bool too: refused by finite_reward
        return _checked(AgentOutcome(reward=res))  # type: ignore[arg-type]
    if isinstance(res, str):
        return AgentOutcome(answer=res)
    return _checked(AgentOutcome(
        reward=res.get("reward"),
        answer=str(res.get("answer", "")),
        transcript=list(res.get("transcript", [])),
    ))


def _checked(out: AgentOutcome) -> AgentOutcome:
    """``out`` with a finite float reward, or closed ``reward_error`` without one."""
    if out.reward is None:
        return out
    try:
        out.reward = finite_reward(out.reward)
    except ValueError:
        out.reward, out.reason = None, "reward_error"
    return out


register_agent_kind("python", PythonKind)
