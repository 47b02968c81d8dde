"""The ``emulated`` agent kind: a simulator scenario's executions, driven through the real proxy.

In: ``task.agent.args`` ``{scenario, k}`` (``tidal run --emulate`` sets them) and, per
execution, its ``AgentContext`` (the proxy URL and the key that names the execution). Out: an
``Outcome`` whose reward is the scenario's draw, after the execution's model calls: each turn a
token-in call (``/inference/v1/generate``) with the conversation so far and ``max_tokens`` the
turn's decode tokens, then the turn's tool latency over ``k``, then the tool's output tokens
appended (the last turn's answer is not decoded: no later call sends its ids, and decoding
10,000 answers of thousands of ids was 40 % of the driver's CPU in the 256-GPU stress,
docs/scale.md). Lengths, turns, tool latencies and rewards are the simulator's own draws
(``sim.workloads.make_workload`` with the scenario's seed: the same distributions the simulator
runs), one group of draws per GRPO group in the order groups first call. A test double at
scale: the tokens are the emulated engines' seeded ids, no model runs.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from tidal.agents.kinds import AgentContext, register_agent_kind, unused
from tidal.config import AgentConfig
from tidal.contracts.executions import Outcome, Turn
from tidal.errors import ConfigError
from tidal.serving.shared_http import SharedHTTP

FIRST_ID, VOCAB = 257, 32000  # the emulated tokenizer's generated ids (serving.emulated)


class EmulatedKind:
    """Runs each execution as the scenario's workload draws it."""

    def __init__(self, spec: AgentConfig, field: str = "task.agent") -> None:
        unused(spec, field, "function", "command", "env", "step")
        from tidal.serving.emulated_timing import resolved_scenario
        from tidal.sim.workloads import make_workload

        args = dict(spec.args)
        if "scenario" not in args:
            raise ConfigError(f"{field}.args.scenario", "the emulated agent needs a scenario")
        extra = set(args) - {"scenario", "k"}
        if extra:
            raise ConfigError(
                f"{field}.args.{sorted(extra)[0]}",
                "unknown argument of the 'emulated' kind (known: scenario, k)",
            )
        try:
            self.k = float(args.get("k", 1.0))
        except (TypeError, ValueError):
            self.k = 0.0
        if not self.k > 0:
            raise ConfigError(f"{field}.args.k", f"a positive time scale, not {args.get('k')!r}")
        self.scenario = resolved_scenario(str(args["scenario"]))
        sc = self.scenario
        self.workload = make_workload(sc.workload, sc.seed, sc.control.batch_groups)
        self.group_size = sc.control.group_size
        self._groups: dict[str, list[Any]] = {}
        self.http = SharedHTTP()  # one transport per run, never one per execution

    def spec_for(self, group_id: str) -> Any:
        """The next member's draw of ``group_id`` (its group drawn when it first calls)."""
        specs = self._groups.get(group_id)
        if specs is None:
            specs = self._groups[group_id] = list(self.workload.group(self.group_size))
        if not specs:  # a retried member of a full group: a fresh draw of the same class
            specs.extend(self.workload.group(self.group_size))
        return specs.pop(0)

    async def run(self, ctx: AgentContext) -> Outcome:
        spec = self.spec_for(ctx.group_id)
        rng = random.Random(f"{ctx.seed}:{ctx.execution_id}")
        ids = [rng.randrange(FIRST_ID, VOCAB) for _ in range(max(1, spec.prompt_tokens))]
        transcript: list[Turn] = []
        async with self.http.client(ctx.proxy_url, ctx.api_key, ctx.timeout_s) as client:
            for i, (decode, tool_s, tool_tokens) in enumerate(spec.turns):
                t_call = time.monotonic()
                resp = await client.post(
                    "/inference/v1/generate",
                    json={
                        "model": ctx.model,
                        "token_ids": ids,
                        "sampling_params": {"max_tokens": int(decode), "seed": ctx.seed + i},
                    },
                )
                if resp.status_code != 200:
                    raise ValueError(f"proxy answered {resp.status_code}: {resp.text[:200]}")
                last = i == len(spec.turns) - 1
                if not last:  # the answer's ids continue the conversation
                    ids = ids + list(resp.json()["choices"][0]["token_ids"])
                elif not resp.content.startswith(b"{"):  # not decoded: nothing reads its ids
                    raise ValueError(f"proxy answered a non-JSON body: {resp.text[:200]}")
                t_tool = time.monotonic()
                if tool_s > 0:
                    await asyncio.sleep(tool_s / self.k)
                if i < len(spec.turns) - 1 and tool_tokens > 0:
                    ids += [rng.randrange(FIRST_ID, VOCAB) for _ in range(int(tool_tokens))]
                transcript.append(
                    Turn(
                        action="",
                        observation="",
                        t_call=t_call,
                        call_s=t_tool - t_call,
                        tool_s=time.monotonic() - t_tool,
                    )
                )
        return Outcome(reward=spec.reward, answer="", transcript=transcript)


register_agent_kind("emulated", EmulatedKind)
