"""The ``verifiers`` agent kind: each execution is an episode driven through verifiers' own train
client path (``renderers.client.generate``, what ``verifiers.v1``'s ``TrainClient`` calls per
turn) against the proxy's token-in route ``/inference/v1/generate``.

With ``task.agent.args.environment`` (``module:function`` returning a ``verifiers.v1.Taskset``,
e.g. ``tidal.agents.verifiers_envs:reasoning_gym_env``, called with ``environment_args``) an
execution plays the environment's task at its row's index through verifiers' ``TrainClient``
(``verifiers_env_episode``; several turns when the task gives feedback, up to
``task.max_turns``) and its reward is the task's own rewards' sum; without it, the row's
messages go through ``renderers.client.generate`` and the run's reward function scores.

In: an execution's task row (prompt or messages), its per-execution base URL and key, the
sampling settings; ``task.agent.args``: ``tokenizer`` (the model directory whose chat template
renders the prompts, required), ``renderer`` (a ``renderers`` config name, default
``default``), ``tool_parser`` (optional), ``environment`` and ``environment_args`` (optional).
Out: an ``Outcome`` with the last answer's text (and the environment's reward). The proxy
records the token ids the engine sampled, which are the ids verifiers received
(``tests/integration/serving/test_openai_conformance.py``, ``test_verifiers_run.py``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from renderers import Renderer
    from verifiers.v1 import Task

    from tidal.agents.kinds import AgentContext
    from tidal.agents.tasks import TaskRow
    from tidal.config import AgentConfig
    from tidal.contracts.executions import Outcome

ARGS = ("tokenizer", "renderer", "tool_parser", "environment", "environment_args")


def model_dir(name: str) -> str:
    """A model directory, or a bundled model's name (``smollm2-135m``: its converted, cached
    directory)."""
    from tidal.models.fetch import KNOWN, fetch

    return str(fetch(name)) if name in KNOWN else name


def make_renderer(
    tokenizer_dir: str, renderer: str = "default", tool_parser: str | None = None
) -> Renderer:
    """A ``renderers`` renderer over the tokenizer of ``tokenizer_dir`` (a local directory:
    nothing is downloaded)."""
    import renderers
    from renderers.base import load_tokenizer

    if renderer != "default":
        raise ValueError(
            f"renderer {renderer!r}: only 'default' (the model's own chat template) is wired"
        )
    config = renderers.DefaultRendererConfig(
        **({"tool_parser": tool_parser} if tool_parser else {})
    )
    return renderers.create_renderer(load_tokenizer(model_dir(tokenizer_dir)), config)


async def run_episode(
    base_url: str,
    api_key: str,
    model: str,
    renderer: Renderer,
    messages: list[dict],
    sampling: dict,
    session: str,
    headers: dict[str, str] | None = None,
) -> dict:
    """One single-turn episode: ``messages`` rendered by ``renderer``, sampled through the
    token-in route under ``base_url`` (an OpenAI ``/v1`` base). Returns verifiers' result
    dict (``prompt_ids``, ``completion_ids``, ``completion_logprobs``, ``content``, ...)."""
    import openai
    from renderers.client import generate

    from tidal.agents.verifiers_env_episode import renderers_lock_for_this_loop

    renderers_lock_for_this_loop()

    from tidal.serving.shared_http import shared_openai_http

    # bound to the execution (URL, key) over the loop's one HTTP client: not closed
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=shared_openai_http()
    )
    return await generate(
        client=client,
        renderer=renderer,
        model=model,
        messages=messages,
        sampling_params=dict(sampling),
        extra_headers={"X-Session-ID": session, **(headers or {})},
    )


class VerifiersKind:
    """``task.agent.kind: verifiers`` (the agent-kind registry's protocol: check the config in
    ``__init__``, run one execution in ``run``)."""

    def __init__(self, spec: AgentConfig, field: str = "task.agent") -> None:
        from tidal.errors import ConfigError

        args = dict(getattr(spec, "args", None) or {})
        unknown = sorted(set(args) - set(ARGS))
        if unknown:
            raise ConfigError(f"{field}.args.{unknown[0]}", f"not one of {', '.join(ARGS)}")
        if not args.get("tokenizer"):
            raise ConfigError(
                f"{field}.args.tokenizer",
                "the model directory whose chat template renders the prompts is required",
            )
        try:
            self.renderer = make_renderer(
                str(args["tokenizer"]),
                str(args.get("renderer", "default")),
                args.get("tool_parser"),
            )
        except ImportError as exc:
            raise ConfigError(
                field, f"the verifiers kind needs verifiers 0.4 (renderers): {exc}"
            ) from None
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{field}.args", str(exc).splitlines()[0]) from None
        self.field = field
        self.tokenizer = model_dir(str(args["tokenizer"]))
        if args.get("environment") and args.get("tool_parser"):
            raise ConfigError(
                f"{field}.args.tool_parser",
                "not used with an environment (its turns carry no tools)",
            )
        if args.get("environment_args") is not None and not args.get("environment"):
            raise ConfigError(f"{field}.args.environment_args", "needs args.environment")
        self.tasks = load_environment(args, field) if args.get("environment") else None

    async def run(self, ctx: AgentContext) -> Outcome:
        from tidal.contracts.executions import Outcome, Turn

        if self.tasks is not None:
            return await self._run_environment(ctx)
        row = ctx.row
        messages = row.messages or [{"role": "user", "content": row.prompt}]
        out = await run_episode(
            ctx.base_url,
            ctx.api_key,
            ctx.model,
            self.renderer,
            messages,
            # no seed: the group's seed is shared by its executions; the
            # proxy derives each call's from the run seed and execution
            {"max_tokens": ctx.max_tokens, "temperature": ctx.temperature},
            session=ctx.execution_id,
        )
        return Outcome(
            answer=out["content"] or "",
            transcript=[Turn(action=out["content"] or "")],
        )

    def check_rows(self, rows: list[Any]) -> None:
        """Every task row meets its environment task (``task_for_row``), else a ConfigError
        naming ``task.agent.args.environment_args`` (run by the workload before a run)."""
        from tidal.errors import ConfigError

        for row in rows if self.tasks is not None else ():
            try:
                task_for_row(self.tasks, row)
            except ValueError as exc:
                raise ConfigError(f"{self.field}.args.environment_args", str(exc)) from None

    async def _run_environment(self, ctx: AgentContext) -> Outcome:
        """The environment's task of this row, its episode (up to ``task.max_turns`` turns
        when the task gives feedback), its reward; the trace's token ids, sampled mask and
        log-probs, and each turn's ids, go to ``.tidal/verifiers_trace.json`` in the workspace."""
        from tidal.agents.verifiers_env_episode import run_task
        from tidal.contracts.executions import Outcome, Turn

        task = task_for_row(self.tasks, ctx.row)
        out = await run_task(
            task,
            ctx.base_url,
            ctx.api_key,
            ctx.model,
            self.tokenizer,
            {"max_tokens": ctx.max_tokens, "temperature": ctx.temperature},
            session=ctx.execution_id,
            max_turns=ctx.max_turns,
        )
        trace = {
            "token_ids": out.token_ids,
            "sampled_mask": out.sampled_mask,
            "logprobs": out.logprobs,
            "rewards": out.rewards,
            "reward": out.reward,
            "turns": out.turns,
        }
        where = ctx.workspace / ".tidal"
        where.mkdir(parents=True, exist_ok=True)
        (where / "verifiers_trace.json").write_text(json.dumps(trace))
        return Outcome(
            reward=out.reward,
            answer=out.answer,
            transcript=[
                Turn(action=turn["content"], observation=turn["feedback"] or "")
                for turn in out.turns
            ],
        )


def load_environment(args: dict, field: str) -> list[Any]:
    """The tasks of the ``verifiers.v1`` taskset that ``args["environment"]``
    (``module:function``) returns when called with ``args["environment_args"]``."""
    from tidal.agents.callables import load_callable
    from tidal.errors import ConfigError

    fn = load_callable(str(args["environment"]), f"{field}.args.environment")
    kwargs = args.get("environment_args") or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{field}.args.environment_args", "a mapping of keyword arguments")
    try:
        taskset = fn(**kwargs)
    except Exception as exc:  # the user's environment may raise anything
        raise ConfigError(
            f"{field}.args.environment",
            f"{args['environment']} raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
        ) from None
    import verifiers.v1 as vf

    if not isinstance(taskset, vf.Taskset) or not taskset.bounded:
        raise ConfigError(
            f"{field}.args.environment",
            f"{args['environment']} returned "
            f"{type(taskset).__name__}, not a finite verifiers.v1 Taskset",
        )
    return list(taskset)


def task_for_row(tasks: list[Task], row: TaskRow) -> Task:
    """The environment's task at the row's index; its prompt must be the row's (the task
    source and the environment name the same dataset), else a ValueError."""
    if row.index >= len(tasks):
        raise ValueError(f"task row {row.index}: the environment has {len(tasks)} tasks")
    task = tasks[row.index]
    users = [m.get("content") for m in row.messages or [] if m.get("role") == "user"]
    asked = row.prompt if row.prompt is not None else (users[-1] if users else None)
    if asked != task.data.prompt_text:
        raise ValueError(
            f"task row {row.index}: the environment's task {row.index} has "
            "another prompt (task.source and task.agent.args.environment_args "
            "must name the same dataset, size and seed)"
        )
    return task


def _register() -> None:
    """Register with the agent-kind registry where it exists (branch agents, issue 26)."""
    try:
        from tidal.agents.kinds import register_agent_kind
    except ImportError:  # a tidal without the registry: run_episode is still usable
        return
    register_agent_kind("verifiers", VerifiersKind)


_register()
