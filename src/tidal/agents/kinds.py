"""Agent kinds: what runs one execution, and the registry a user (or another module of tidal)
adds kinds to without editing tidal.

In: an ``AgentContext`` per execution (its id and group, the task row, its own workspace, an
OpenAI base URL and key bound to it, the model name, the limits). Out: an ``Outcome``
(``tidal.contracts.executions``: a reward, or None to leave it to the run's reward function; the
final answer, the transcript as ``Turn``s, a command's exit code and output tails): ``run`` is the
only way an execution ends, built-in tasks (``tidal.agents.builtin_tasks``) included. A kind is
constructed once per run from the config's ``task.agent`` section (its constructor checks its
input and raises a ``ConfigError`` naming the field: that runs before anything starts) and its
``run`` is called once per execution; the harness pool cancels it at the execution's timeout.

Built-in kinds: ``chat`` (here: tidal's multi-turn loop over the row's messages, with the
environment's feedback from the user's optional ``step`` callable), ``python``
(``tidal.agents.agent_python``) and ``command`` (``tidal.agents.agent_command``). The interface
is written down in SHAPES.md (``verifiers`` registers from ``tidal.agents.verifiers_kind``).
"""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tidal.agents.callables import load_callable, parameters
from tidal.agents.tasks import TaskRow
from tidal.config import AgentConfig
from tidal.contracts.executions import Outcome, Turn
from tidal.errors import ConfigError
from tidal.serving.shared_http import SharedHTTP


@dataclass(frozen=True)
class AgentContext:
    """What one execution's agent receives (see SHAPES.md)."""

    execution_id: str
    group_id: str
    row: TaskRow
    workspace: Path
    base_url: str  # f"{proxy_url}/x/{execution_id}/v1": names the execution, no header needed
    api_key: str  # names the execution on the plain proxy URL too
    proxy_url: str
    model: str
    timeout_s: float
    max_tokens: int
    max_turns: int
    temperature: float
    seed: int
    args: dict[str, Any] = field(default_factory=dict)


class AgentKind(Protocol):
    def __init__(self, spec: AgentConfig, field: str = "task.agent") -> None: ...
    async def run(self, ctx: AgentContext) -> Outcome: ...


_KINDS: dict[str, Callable[..., AgentKind]] = {}
# modules that register kinds when imported (an absent one is skipped)
_PLUGINS = (
    "tidal.agents.agent_python",
    "tidal.agents.agent_command",
    "tidal.agents.verifiers_kind",
    "tidal.agents.emulated_agent",
)
_loaded = False


def register_agent_kind(name: str, factory: Callable[..., AgentKind]) -> None:
    """Makes ``task.agent.kind: <name>`` build ``factory(spec, field)``."""
    _KINDS[name] = factory


def agent_kinds() -> list[str]:
    _load_plugins()
    return sorted(_KINDS)


def build_agent(spec: AgentConfig, field: str = "task.agent") -> AgentKind:
    """The kind ``spec.kind`` names, built (and so checked) from its config section."""
    _load_plugins()
    factory = _KINDS.get(spec.kind)
    if factory is None:
        missing = "".join(f"; {name} not loaded: {why}" for name, why in _BROKEN.items())
        raise ConfigError(
            f"{field}.kind",
            f"unknown agent kind {spec.kind!r} (known: {', '.join(sorted(_KINDS))}{missing})",
        )
    return factory(spec, field)


_BROKEN: dict[str, str] = {}  # a plugin module whose import failed -> why


def _load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in _PLUGINS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the plugin is there but a module it needs is not
                _BROKEN[name] = f"no module named {exc.name!r}"


def unused(spec: AgentConfig, field: str, *names: str) -> None:
    """A kind refuses the fields of other kinds (set, they would be silently ignored)."""
    for name in names:
        if getattr(spec, name):
            raise ConfigError(f"{field}.{name}", f"not used by the {spec.kind!r} agent kind")


class ChatKind:
    """tidal's multi-turn loop: the row's messages to the model; after each answer the user's
    ``step`` (optional) gives the environment's feedback: ``None`` ends the episode, a string is
    the next user message, a dict ``{observation, done, reward}`` says all three. Without a
    ``step`` the episode is one answer. The callable gets whichever of ``row``, ``answer``,
    ``messages``, ``workspace``, ``turn`` it names (sync or async)."""

    def __init__(self, spec: AgentConfig, field: str = "task.agent") -> None:
        unused(spec, field, "function", "command", "env")
        self.step = load_callable(spec.step, f"{field}.step") if spec.step else None
        self.wants = set(parameters(self.step)) if self.step else set()
        self.system_prompt = spec.args.get("system_prompt")
        extra = set(spec.args) - {"system_prompt"}
        if extra:
            raise ConfigError(
                f"{field}.args.{sorted(extra)[0]}",
                "unknown argument of the 'chat' kind (known: system_prompt)",
            )
        self.http = SharedHTTP()

    async def run(self, ctx: AgentContext) -> Outcome:
        answer, reward, transcript = "", None, []
        messages = ctx.row.chat(self.system_prompt)
        async with self.http.client(ctx.base_url, ctx.api_key, ctx.timeout_s) as client:
            for turn in range(ctx.max_turns):
                t_call = time.monotonic()
                resp = await client.post(
                    "/chat/completions",
                    json={
                        "model": ctx.model,
                        "messages": messages,
                        "max_tokens": ctx.max_tokens,
                        "temperature": ctx.temperature,
                        "logprobs": True,
                    },
                )
                if resp.status_code != 200:
                    raise ValueError(f"proxy answered {resp.status_code}: {resp.text[:200]}")
                answer = resp.json()["choices"][0]["message"]["content"] or ""
                t_tool = time.monotonic()
                obs, done, given = await self._feedback(ctx, answer, messages, turn)
                # timings (monotonic clock) for `tidal calibrate`: call start, call and tool s
                transcript.append(
                    Turn(
                        action=answer,
                        observation=obs or "",
                        t_call=t_call,
                        call_s=t_tool - t_call,
                        tool_s=time.monotonic() - t_tool,
                    )
                )
                if given is not None:
                    reward = given
                if done:
                    break
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": obs or ""},
                ]
        return Outcome(reward=reward, answer=answer, transcript=transcript)

    async def _feedback(
        self, ctx: AgentContext, answer: str, messages: list[dict], turn: int
    ) -> tuple[str | None, bool, float | None]:
        if self.step is None:
            return None, True, None
        given = {
            "row": ctx.row,
            "answer": answer,
            "messages": messages,
            "workspace": ctx.workspace,
            "turn": turn,
        }
        kwargs = (
            given if "**" in self.wants else {k: v for k, v in given.items() if k in self.wants}
        )
        res = self.step(**kwargs)
        if inspect.isawaitable(res):
            res = await res
        if res is None:
            return None, True, None
        if isinstance(res, str):
            return res, False, None
        if isinstance(res, dict):
            reward = res.get("reward")
            return (
                str(res.get("observation", "")),
                bool(res.get("done", False)),
                None if reward is None else float(reward),
            )
        raise TypeError(f"step returned {type(res).__name__}: expected None, str or dict")


register_agent_kind("chat", ChatKind)
