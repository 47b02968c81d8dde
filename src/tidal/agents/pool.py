"""The harness pool: runs executions concurrently (asyncio), each in its own workspace, talking
to models only through the proxy's OpenAI-compatible HTTP API.

In: tasks (an ``Environment`` factory per execution, or an ``AgentJob`` of the run's ``task:``
section: a user's chat step, Python agent or command, ``tidal.agents.workload``) and a proxy
URL. Out: one
``ExecutionResult`` per task, and ledger events ``dispatched`` (queued), ``launched`` (started)
and ``closed`` (completed / failed / timeout, with the reward) on the injected ``LedgerEvents``.
A timeout closes the execution with reason ``timeout`` and scores what it produced. Workspaces
persist on local disk whatever engine serves the execution. An agent job gets its execution's
own base URL and key (``tidal.agents.identity``), so a harness that cannot add a header is still
counted to its execution; what it did is summed up in ``.tidal/outcome.json`` of its workspace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field

from tidal.agents.environments import Environment
from tidal.agents.events import EventLog, ExecutionRegistry, LedgerEvents
from tidal.agents.identity import execution_key, execution_url
from tidal.agents.kinds import AgentContext
from tidal.agents.workload import AgentJob, run_job, write_outcome

log = logging.getLogger(__name__)


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    proxy_url: str
    model: str | None = None
    max_concurrent: int = Field(64, ge=1)
    max_turns: int = Field(8, ge=1)
    max_tokens_per_turn: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    timeout_s: float = Field(300.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    token: str | None = None  # the proxy's token: reporting a close (a reward) needs it


@dataclass
class ExecutionResult:
    execution_id: str
    group_id: str
    reason: str
    reward: float
    turns: int
    workspace: Path
    transcript: list[dict] = field(default_factory=list)
    exit_code: int | None = None  # a command agent's exit code


class HarnessPool:
    def __init__(self, config: PoolConfig, workspace_root: Path,
                 events: LedgerEvents | None = None) -> None:
        self.config = config
        self.workspace_root = Path(workspace_root)
        self.registry = ExecutionRegistry(events or EventLog())
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._model: str | None = config.model

    async def run(self, tasks: list[tuple[str, Callable[[], Environment]]],
                  execution_ids: list[str] | None = None) -> list[ExecutionResult]:
        """Run ``(group_id, make_env)`` tasks; every one returns a result (never raises).
        ``execution_ids`` names the executions (default: fresh unique ids)."""
        if execution_ids is not None and len(execution_ids) != len(tasks):
            raise ValueError(f"{len(execution_ids)} execution ids for {len(tasks)} tasks")
        ids = execution_ids or [None] * len(tasks)
        limits = httpx.Limits(max_connections=self.config.max_concurrent + 4)
        auth = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        async with httpx.AsyncClient(base_url=self.config.proxy_url, limits=limits,
                                     timeout=self.config.request_timeout_s,
                                     headers=auth) as client:
            states = [self.registry.dispatch(group, execution_id=eid)
                      for (group, _), eid in zip(tasks, ids, strict=True)]
            return list(await asyncio.gather(*[
                self._execute(client, st.execution_id, st.group_id, make_env)
                for st, (_, make_env) in zip(states, tasks, strict=True)]))

    async def _execute(self, client: httpx.AsyncClient, eid: str, group: str,
                       make_env: Callable[[], Environment] | AgentJob) -> ExecutionResult:
        async with self._slots:
            self.registry.launch(eid)
            if isinstance(make_env, AgentJob):
                return await self._agent(client, eid, group, make_env)
            env = make_env()
            result = ExecutionResult(eid, group, "completed", 0.0, 0,
                                     self.workspace_root / eid)
            try:
                await client.post("/tidal/executions", json={"execution_id": eid,
                                                              "group_id": group})
                await asyncio.wait_for(self._turns(client, eid, env, result),
                                       self.config.timeout_s)
            except TimeoutError:
                result.reason = "timeout"
                result.reward = env.score()  # timed-out executions are scored as they stand
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.warning("execution %s failed: %s", eid, exc)
                result.reason = "failed"
                result.reward = env.score()
            self.registry.close(eid, result.reason, result.reward)
            try:
                await client.post(f"/tidal/executions/{eid}/close",
                                  json={"reward": result.reward, "reason": result.reason})
            except httpx.HTTPError as exc:
                log.warning("execution %s: close not reported to the proxy: %s", eid, exc)
            return result

    async def _agent(self, client: httpx.AsyncClient, eid: str, group: str,
                     job: AgentJob) -> ExecutionResult:
        """One execution of a user's agent (``tidal.agents.workload.run_job``)."""
        cfg, ws = self.config, self.workspace_root / eid
        result = ExecutionResult(eid, group, "failed", 0.0, 0, ws)
        try:
            await client.post("/tidal/executions", json={"execution_id": eid,
                                                          "group_id": group})
            ctx = AgentContext(eid, group, job.row, ws, execution_url(cfg.proxy_url, eid),
                               execution_key(cfg.token or "", eid), cfg.proxy_url,
                               await self._served_model(client), cfg.timeout_s,
                               cfg.max_tokens_per_turn, cfg.max_turns, cfg.temperature,
                               job.seed, job.args)
            done = await run_job(job, ctx)
            result.reason, result.reward = done.reason, done.reward
            result.transcript, result.exit_code = done.outcome.transcript, done.outcome.exit_code
            result.turns = len(done.outcome.transcript)
            write_outcome(ws, done)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            log.warning("execution %s failed: %s", eid, exc)
        reward = None if result.reason == "reward_error" else result.reward
        self.registry.close(eid, result.reason, reward)
        try:
            await client.post(f"/tidal/executions/{eid}/close",
                              json={"reward": reward, "reason": result.reason})
        except httpx.HTTPError as exc:
            log.warning("execution %s: close not reported to the proxy: %s", eid, exc)
        if result.exit_code is not None:
            log.info("execution %s: the agent exited %d", eid, result.exit_code)
        return result

    async def _served_model(self, client: httpx.AsyncClient) -> str:
        """The model name the proxy serves (asked once)."""
        if self._model is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            data = resp.json()["data"]
            self._model = data[0]["id"] if data else "tidal"
        return self._model

    async def _turns(self, client: httpx.AsyncClient, eid: str, env: Environment,
                     result: ExecutionResult) -> None:
        obs = await env.reset(result.workspace)
        messages = [{"role": "system", "content": env.system_prompt},
                    {"role": "user", "content": obs}]
        for turn in range(self.config.max_turns):
            body = {"messages": messages, "max_tokens": self.config.max_tokens_per_turn,
                    "temperature": self.config.temperature, "logprobs": True}
            if self.config.model:
                body["model"] = self.config.model
            t_call = time.monotonic()
            resp = await client.post("/v1/chat/completions", json=body,
                                     headers={"X-Tidal-Execution": eid})
            if resp.status_code != 200:
                raise ValueError(f"proxy answered {resp.status_code}: {resp.text[:200]}")
            text = resp.json()["choices"][0]["message"]["content"]
            t_tool = time.monotonic()
            step = await env.step(text)
            result.turns = turn + 1
            # timings (monotonic clock) for `tidal calibrate`: call start, call and tool seconds
            result.transcript.append({"action": text, "observation": step.observation,
                                      "t_call": t_call, "call_s": t_tool - t_call,
                                      "tool_s": time.monotonic() - t_tool})
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": step.observation or "ok"}]
            if step.done:
                result.reward = step.reward
                return
        result.reward = env.score()
