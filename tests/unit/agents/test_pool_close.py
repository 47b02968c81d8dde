"""One registration of an execution: the proxy owns it (registered and closed there with the
run's token), the pool keeps no registry and reports to the ledger the close the proxy kept;
the agent gets its execution's own URL and key, never the run token. The proxy here is an
``httpx.MockTransport`` answering as ``tidal.serving.proxy_handlers`` does."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tidal.agents import EventLog, HarnessPool, PoolConfig
from tidal.agents.tasks import TaskRow
from tidal.agents.workload import AgentJob
from tidal.contracts.close import CloseReason
from tidal.contracts.executions import Outcome

TOKEN = "run-token"


class _Agent:
    def __init__(self) -> None:
        self.contexts = []

    async def run(self, ctx) -> Outcome:
        self.contexts.append(ctx)
        return Outcome(reward=1.0, answer="42")


class _Proxy:
    """Registration and close as the proxy answers them; ``closed_first`` pre-closes ids."""

    def __init__(self, closed_first: dict | None = None, refuse: bool = False) -> None:
        self.closed = dict(closed_first or {})
        self.refuse, self.seen = refuse, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, request.headers.get("authorization")))
        path = request.url.path
        if path == "/tidal/executions":
            return httpx.Response(409 if self.refuse else 200, json={"ok": True})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        eid = path.split("/")[3]
        body = json.loads(request.content)
        first = eid not in self.closed
        if first:
            self.closed[eid] = (body["reason"], body["reward"])
        reason, reward = self.closed[eid]
        return httpx.Response(
            200,
            json={
                "closed": True,
                "duplicate": not first,
                "reason": reason,
                "reward": reward,
                "calls": 0,
            },
        )


def _run(tmp_path, proxy: _Proxy, agent: _Agent, ids: list[str]):
    events = EventLog()
    pool = HarnessPool(
        PoolConfig(proxy_url="http://proxy.test", token=TOKEN),
        tmp_path,
        events,
        transport=httpx.MockTransport(proxy),
    )
    job = AgentJob(TaskRow(0, prompt="q"), agent, None, 0, {})
    return asyncio.run(pool.run([("g", job)] * len(ids), ids)), events


def test_the_proxy_owns_the_close_and_the_agent_its_own_key(tmp_path):
    proxy, agent = _Proxy(), _Agent()
    (done,), events = _run(tmp_path, proxy, agent, ["g-e0"])
    assert done.outcome.reason == CloseReason.COMPLETED and done.outcome.reward == 1.0
    assert events.events == [
        ("dispatched", "g-e0", "g"),
        ("launched", "g-e0", "g"),
        ("closed", "g-e0", "g", CloseReason.COMPLETED, 1.0),
    ]
    assert proxy.closed == {"g-e0": ("completed", 1.0)}
    # registration and close are admin calls with the run's token
    assert {auth for _, _, auth in proxy.seen} == {f"Bearer {TOKEN}"}
    (ctx,) = agent.contexts
    assert ctx.base_url == "http://proxy.test/x/g-e0/v1"
    assert ctx.api_key.startswith("tx-g-e0.") and TOKEN not in ctx.api_key


def test_a_close_the_proxy_kept_first_is_what_the_ledger_hears(tmp_path):
    """The proxy closed it first (e.g. expired idle as ``timeout``): the pool reports that."""
    proxy = _Proxy(closed_first={"g-e0": ("timeout", 0.0)})
    (done,), events = _run(tmp_path, proxy, _Agent(), ["g-e0"])
    assert done.outcome.reason == CloseReason.TIMEOUT and done.outcome.reward == 0.0
    assert events.events[-1] == ("closed", "g-e0", "g", CloseReason.TIMEOUT, 0.0)


def test_a_refused_registration_fails_the_execution_without_running_it(tmp_path):
    agent = _Agent()
    (done,), events = _run(tmp_path, _Proxy(refuse=True), agent, ["g-e0"])
    assert done.outcome.reason == CloseReason.FAILED and "409" in done.outcome.detail
    assert not agent.contexts and events.events[-1][3] == CloseReason.FAILED


class _Blocking:
    """An agent that runs until it is stopped (a straggler at the run's end)."""

    def __init__(self) -> None:
        self.started, self.stopped = 0, 0

    async def run(self, ctx) -> Outcome:
        self.started += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.stopped += 1
        raise AssertionError("never returns")


def test_the_runs_end_closes_open_executions_cancelled_at_the_proxy(tmp_path):
    """``end_open``: the running agents stop and those still waiting for a slot never start;
    each closes ``cancelled`` (reward 0.0), at the proxy and in the ledger, exactly once, and
    its record is one the trajectory buffer takes."""
    proxy, agent, events = _Proxy(), _Blocking(), EventLog()
    pool = HarnessPool(
        PoolConfig(proxy_url="http://proxy.test", token=TOKEN, max_concurrent=2),
        tmp_path,
        events,
        transport=httpx.MockTransport(proxy),
    )
    job = AgentJob(TaskRow(0, prompt="q"), agent, None, 0, {})
    ids = ["g-e0", "g-e1", "g-e2"]

    async def go():
        run = asyncio.ensure_future(pool.run([("g", job)] * 3, ids))
        for _ in range(50):
            await asyncio.sleep(0)
        assert agent.started == 2  # the third waits for a slot
        assert pool.end_open() == 2
        return await asyncio.wait_for(run, 5.0)

    done = asyncio.run(go())
    assert [d.outcome.reason for d in done] == [CloseReason.CANCELLED] * 3
    assert all(d.outcome.reward == 0.0 for d in done)
    assert agent.started == agent.stopped == 2 and pool.ended == 3
    assert proxy.closed == {e: ("cancelled", 0.0) for e in ids}
    closes = [e for e in events.events if e[0] == "closed"]
    assert sorted(c[1] for c in closes) == ids and {c[3] for c in closes} == {CloseReason.CANCELLED}
    from tidal.training.records import record_from_proxy

    rec = record_from_proxy("g-e0", "g", [], done[0].outcome.reward, done[0].outcome.reason)
    assert rec.reason == CloseReason.CANCELLED  # the buffer takes it: not lost


def test_a_pool_cancelled_from_outside_is_not_a_runs_end(tmp_path):
    """Cancelling the pool's own task (the run stopping on a failure) still cancels it."""
    pool = HarnessPool(
        PoolConfig(proxy_url="http://proxy.test", token=TOKEN),
        tmp_path,
        EventLog(),
        transport=httpx.MockTransport(_Proxy()),
    )
    job = AgentJob(TaskRow(0, prompt="q"), _Blocking(), None, 0, {})

    async def go():
        run = asyncio.ensure_future(pool.run([("g", job)], ["g-e0"]))
        for _ in range(50):
            await asyncio.sleep(0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(go())
