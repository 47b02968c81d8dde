"""The harness pool: runs executions concurrently (asyncio), each in its own workspace, talking
to models only through the proxy's OpenAI-compatible HTTP API.

In: ``(group_id, AgentJob)`` tasks (``tidal.agents.workload``: the row, the agent kind, the
reward; built-in tasks are a task source like any other) and the proxy's URL and run token.
Out: one ``ExecutionOutcome`` per task (its ``Outcome``, from ``AgentKind.run`` through
``run_job``: the one way an execution ends), and ledger events ``dispatched`` (queued),
``launched`` (started) and ``closed`` (with the reason and reward) on the injected
``LedgerEvents``.

One registration: the proxy owns an execution's identity and its close (its registry keeps
close-exactly-once and refuses a closed execution's calls). The pool registers each execution
there (``POST /tidal/executions``, the run token) and closes it there
(``POST /tidal/executions/{id}/close``), and reports to the ledger the close the proxy recorded
(a duplicate, e.g. one the proxy expired first, is reported as the proxy has it); it keeps no
registry of its own. The agent talks to the proxy with its execution's own base URL and key
(``tidal.agents.identity``), never the run token. Workspaces persist on local disk whatever
engine serves the execution; what an execution did is summed up in ``.tidal/outcome.json``.
At the run's end (``end_open``, once the last version is published) executions still open,
carried past it by the staleness budget (``tidal.control.carry_over``), stop and close
``cancelled`` (reward 0.0, never trained), through the same close and record path as every
other.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field

from tidal.agents.events import EventLog, LedgerEvents
from tidal.agents.identity import execution_key, execution_url
from tidal.agents.kinds import AgentContext
from tidal.agents.workload import AgentJob, closed, run_job, write_outcome
from tidal.contracts.close import CLOSE_REASONS, CloseReason
from tidal.contracts.executions import ExecutionOutcome, Outcome
from tidal.serving.shared_http import idempotent, why

log = logging.getLogger(__name__)

#: An execution open at the run's end (``HarnessPool.end_open``): carried past the last version
#: by the staleness budget, it never trains; scored 0.0 as a failed one is (a record's reward is
#: None only for ``reward_error``).
ENDED = Outcome(
    reason=CloseReason.CANCELLED,
    reward=0.0,
    detail="open at the run's end (carried past the last version): stopped, never trained",
)


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
    token: str | None = None  # the run's token: registering and closing executions need it
    # several proxy processes (tidal.serving.proxy_set): each execution's calls go to its owner
    proxy_urls: list[str] = Field(default_factory=list)

    def url_for(self, execution_id: str) -> str:
        """The proxy that serves ``execution_id`` (``proxy_url`` with one process)."""
        if len(self.proxy_urls) < 2:
            return self.proxy_url
        from tidal.serving.proxy_set import owner

        return self.proxy_urls[owner(execution_id, len(self.proxy_urls))]


class HarnessPool:
    def __init__(
        self,
        config: PoolConfig,
        workspace_root: Path,
        events: LedgerEvents | None = None,
        transport: httpx.AsyncBaseTransport | None = None,  # the proxy's, for the admin calls
    ) -> None:
        self.config = config
        # one transport for every group's admin client: an ``httpx.AsyncClient`` of its own
        # costs ~15 ms of CPU and ~0.9 MB (its TLS context), per group (docs/scale.md)
        if transport is None:
            from tidal.serving.proxy_set import FanOut
            from tidal.serving.shared_http import Sharded

            # several pools: httpcore's one pool scans all its connections per request, O(n^2)
            # at 10,000 executions in flight (docs/scale.md)
            transport = FanOut([config.proxy_url], Sharded(), keep_open=True)
        self._transport = transport
        self.workspace_root = Path(workspace_root)
        self.events = events or EventLog()
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._model: str | None = config.model
        self._asking: asyncio.Future[str] | None = None  # the one /v1/models request
        self._jobs: set[asyncio.Task[Outcome]] = set()  # the agents running now
        self._ending = False  # ``end_open`` was called: what is open closes ``cancelled``
        self.ended = 0  # executions closed ``cancelled`` by the run's end

    async def run(
        self, tasks: list[tuple[str, AgentJob]], execution_ids: list[str] | None = None
    ) -> list[ExecutionOutcome]:
        """Run ``(group_id, job)`` tasks; every one returns an outcome (never raises).
        ``execution_ids`` names the executions (default: ``<group>-<random hex>``)."""
        if execution_ids is not None and len(execution_ids) != len(tasks):
            raise ValueError(f"{len(execution_ids)} execution ids for {len(tasks)} tasks")
        ids = execution_ids or [self._fresh_id(group) for group, _ in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError("execution ids repeat")
        limits = httpx.Limits(max_connections=self.config.max_concurrent + 4)
        auth = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        async with httpx.AsyncClient(
            base_url=self.config.proxy_url,
            limits=limits,
            timeout=self.config.request_timeout_s,
            headers=auth,
            transport=self._transport,
        ) as admin:
            for (group, _), eid in zip(tasks, ids, strict=True):
                self.events.dispatched(eid, group)
            return list(
                await asyncio.gather(
                    *[
                        self._execute(admin, eid, group, job)
                        for eid, (group, job) in zip(ids, tasks, strict=True)
                    ]
                )
            )

    @staticmethod
    def _fresh_id(group: str) -> str:
        return f"{group}-{uuid.uuid4().hex[:12]}"

    async def _execute(
        self, admin: httpx.AsyncClient, eid: str, group: str, job: AgentJob
    ) -> ExecutionOutcome:
        async with self._slots:
            self.events.launched(eid, group)
            cfg, ws = self.config, self.workspace_root / eid
            try:
                resp = await admin.post(
                    "/tidal/executions", json={"execution_id": eid, "group_id": group}
                )
                if resp.status_code != 200:
                    raise ValueError(f"proxy refused it: {resp.status_code} {resp.text[:200]}")
                ctx = AgentContext(
                    eid,
                    group,
                    job.row,
                    ws,
                    execution_url(cfg.url_for(eid), eid),
                    execution_key(cfg.token or "", eid),
                    cfg.url_for(eid),
                    await self._served_model(admin),
                    cfg.timeout_s,
                    cfg.max_tokens_per_turn,
                    cfg.max_turns,
                    cfg.temperature,
                    job.seed,
                    job.args,
                )
                outcome = await self._job(job, ctx)
                write_outcome(ws, outcome)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                log.warning("execution %s failed: %s", eid, exc)
                outcome = Outcome(reason=CloseReason.FAILED, reward=0.0, detail=str(exc)[:200])
            outcome = await self._close(admin, eid, group, outcome)
            if outcome.exit_code is not None:
                log.info("execution %s: the agent exited %d", eid, outcome.exit_code)
            return ExecutionOutcome(execution_id=eid, group_id=group, outcome=outcome)

    async def _close(
        self, admin: httpx.AsyncClient, eid: str, group: str, outcome: Outcome
    ) -> Outcome:
        """Closes the execution at the proxy (its owner) and reports that close to the ledger:
        the proxy's if it had closed it already; ours if the proxy cannot be reached (the
        ledger's own close-once still holds)."""
        try:
            resp = await idempotent(  # a close is kept once: a repeat changes nothing
                lambda: admin.post(
                    f"/tidal/executions/{eid}/close",
                    json={"reward": outcome.reward, "reason": outcome.reason},
                ),
                f"execution {eid}: close",
            )
            resp.raise_for_status()
            body = resp.json()
            if body.get("duplicate") and body.get("reason") in CLOSE_REASONS:
                outcome = closed(outcome, CloseReason(body["reason"]), body.get("reward"))
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("execution %s: close not reported to the proxy: %s", eid, why(exc))
        self.events.closed(eid, group, outcome.reason, outcome.reward)
        return outcome

    async def _job(self, job: AgentJob, ctx: AgentContext) -> Outcome:
        """The agent's run, or a ``cancelled`` outcome once ``end_open`` ends it (or at once,
        for an execution that gets its slot after the end)."""
        if self._ending:
            self.ended += 1
            return ENDED
        work = asyncio.ensure_future(run_job(job, ctx))
        self._jobs.add(work)
        try:
            return await work
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not (self._ending and work.cancelled()) or (task and task.cancelling()):
                raise  # our own cancellation, not the run's end
            self.ended += 1
            return ENDED
        finally:
            self._jobs.discard(work)

    def end_open(self) -> int:
        """The run's end: every execution still open stops its agent and closes ``cancelled``,
        reward 0.0 (at the proxy and in the ledger, as any close; its record, the calls it made, is
        delivered as any other), and those not yet started close the same way without
        running. Returns the agents stopped."""
        self._ending = True
        jobs = list(self._jobs)
        for work in jobs:
            work.cancel()
        return len(jobs)

    @staticmethod
    def end_all() -> int:
        """Kills what command agents started and is still alive, and every worker process of
        the user's Python code (killed, never waited on): the run's end."""
        from tidal.agents.agent_command import end_all
        from tidal.agents.python_workers import close_all

        ended = end_all()
        close_all()
        return ended

    async def _served_model(self, client: httpx.AsyncClient) -> str:
        """The model name the proxy serves (asked once, by the first execution: the others
        await that one answer, not 10,000 concurrent requests; a failure is asked again)."""
        if self._model is not None:
            return self._model
        if self._asking is None or (self._asking.done() and self._asking.exception()):
            self._asking = asyncio.ensure_future(self._ask_model(client))
        self._model = await asyncio.shield(self._asking)
        return self._model

    @staticmethod
    async def _ask_model(client: httpx.AsyncClient) -> str:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        data = resp.json()["data"]
        return data[0]["id"] if data else "tidal"
