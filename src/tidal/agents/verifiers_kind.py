"""The ``verifiers`` agent kind: each execution is an episode driven through verifiers' own train
client path (``renderers.client.generate``, what ``verifiers.v1``'s ``TrainClient`` calls per
turn) against the proxy's token-in route ``/inference/v1/generate``.

In: an execution's task row (prompt or messages), its per-execution base URL and key, the
sampling settings; ``task.agent.args``: ``tokenizer`` (the model directory whose chat template
renders the prompts, required), ``renderer`` (a ``renderers`` config name, default
``default``), ``tool_parser`` (optional). Out: ``AgentOutcome`` with the last answer's text;
the reward is the run's reward function's (a reasoning-gym task source scores with
reasoning-gym). The proxy records the token ids the engine sampled, which are the ids verifiers
received (``tests/integration/serving/test_openai_conformance.py``).
"""

from __future__ import annotations

from typing import Any

ARGS = ("tokenizer", "renderer", "tool_parser")


def make_renderer(tokenizer_dir: str, renderer: str = "default",
                  tool_parser: str | None = None) -> Any:
    """A ``renderers`` renderer over the tokenizer of ``tokenizer_dir`` (a local directory:
    nothing is downloaded)."""
    import renderers
    from renderers.base import load_tokenizer

    if renderer != "default":
        raise ValueError(f"renderer {renderer!r}: only 'default' (the model's own chat "
                         "template) is wired")
    config = renderers.DefaultRendererConfig(**({"tool_parser": tool_parser}
                                                if tool_parser else {}))
    return renderers.create_renderer(load_tokenizer(tokenizer_dir), config)


async def run_episode(base_url: str, api_key: str, model: str, renderer: Any,
                      messages: list[dict], sampling: dict, session: str,
                      headers: dict[str, str] | None = None) -> dict:
    """One single-turn episode: ``messages`` rendered by ``renderer``, sampled through the
    token-in route under ``base_url`` (an OpenAI ``/v1`` base). Returns verifiers' result
    dict (``prompt_ids``, ``completion_ids``, ``completion_logprobs``, ``content``, ...)."""
    import openai
    from renderers.client import generate

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        return await generate(client=client, renderer=renderer, model=model,
                              messages=messages, sampling_params=dict(sampling),
                              extra_headers={"X-Session-ID": session, **(headers or {})})


class VerifiersKind:
    """``task.agent.kind: verifiers`` (the agent-kind registry's protocol: check the config in
    ``__init__``, run one execution in ``run``)."""

    def __init__(self, spec: Any, field: str = "task.agent") -> None:
        from tidal.errors import ConfigError

        args = dict(getattr(spec, "args", None) or {})
        unknown = sorted(set(args) - set(ARGS))
        if unknown:
            raise ConfigError(f"{field}.args.{unknown[0]}", f"not one of {', '.join(ARGS)}")
        if not args.get("tokenizer"):
            raise ConfigError(f"{field}.args.tokenizer", "the model directory whose chat "
                              "template renders the prompts is required")
        try:
            self.renderer = make_renderer(str(args["tokenizer"]),
                                          str(args.get("renderer", "default")),
                                          args.get("tool_parser"))
        except ImportError as exc:
            raise ConfigError(field, f"the verifiers kind needs verifiers 0.4 (renderers): "
                              f"{exc}") from None
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{field}.args", str(exc).splitlines()[0]) from None

    async def run(self, ctx: Any) -> Any:
        from tidal.agents.kinds import AgentOutcome

        row = ctx.row
        messages = row.messages or [{"role": "user", "content": row.prompt}]
        out = await run_episode(ctx.base_url, ctx.api_key, ctx.model, self.renderer, messages,
                                # no seed: the group's seed is shared by its executions; the
                                # proxy derives each call's from the run seed and execution
                                {"max_tokens": ctx.max_tokens, "temperature": ctx.temperature},
                                session=ctx.execution_id)
        return AgentOutcome(answer=out["content"] or "", transcript=[
            {"action": out["content"] or "", "observation": "",
             "completion_tokens": len(out["completion_ids"])}])


def _register() -> None:
    """Register with the agent-kind registry where it exists (branch agents, issue 26)."""
    try:
        from tidal.agents.kinds import register_agent_kind
    except ImportError:  # a tidal without the registry: run_episode is still usable
        return
    register_agent_kind("verifiers", VerifiersKind)


_register()
