"""The harness pool drives the built-in task sources (multi-turn workspace, single-turn
arithmetic) through the ``chat`` agent kind, the proxy and real engines; a slow one times out
and is closed with reason ``timeout``; the quickstart's executions run through
``AgentKind.run``, each closed once at the proxy that owns it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tidal.agents import EventLog, HarnessPool, PoolConfig
from tidal.agents.kinds import ChatKind
from tidal.agents.workload import Workload
from tidal.config import RunConfig, load_yaml, validate_model
from tidal.contracts.close import CloseReason

ROOT = Path(__file__).resolve().parents[3]


def _workload(source: dict, max_turns: int) -> Workload:
    return Workload(validate_model(RunConfig, {"task": {"source": source, "max_turns": max_turns}}))


def _jobs(workload: Workload, group: str, n: int) -> list:
    return [(group, workload.job(0, i, seed=i)) for i in range(n)]


def test_pool_runs_executions_and_times_out_slow_ones(cluster, tmp_path):
    events = EventLog()
    pool = HarnessPool(
        PoolConfig(
            proxy_url=cluster.url,
            max_turns=3,
            max_tokens_per_turn=16,
            timeout_s=20.0,
            token=cluster.token,
        ),
        tmp_path,
        events,
    )
    ws = _workload({"kind": "workspace", "tool_latency_s": 0.005}, 3)
    math = _workload({"kind": "arithmetic"}, 1)
    results = asyncio.run(pool.run(_jobs(ws, "ws", 6) + _jobs(math, "math", 6)))
    assert [r.outcome.reason for r in results] == [CloseReason.COMPLETED] * 12
    for r in results[:6]:
        assert 1 <= r.outcome.turns <= 3 and (tmp_path / r.execution_id / "data0.txt").is_file()
        assert all(t.call_s is not None and t.tool_s is not None for t in r.outcome.transcript)
    assert all(r.outcome.turns == 1 for r in results[6:])

    slow_pool = HarnessPool(
        PoolConfig(proxy_url=cluster.url, max_turns=50, timeout_s=0.5, token=cluster.token),
        tmp_path,
        events,
    )
    slow = _workload({"kind": "workspace", "tool_latency_s": 100.0}, 50)  # 5 s per command
    (timed_out,) = asyncio.run(slow_pool.run(_jobs(slow, "slow", 1)))
    assert timed_out.outcome.reason == CloseReason.TIMEOUT and timed_out.outcome.reward == 0.0
    closed = [e for e in events.events if e[0] == "closed"]
    assert len(closed) == 13 and closed[-1][3] == CloseReason.TIMEOUT
    per_exec = {}
    for e in events.events:
        per_exec.setdefault(e[1], []).append(e[0])
    assert all(v == ["dispatched", "launched", "closed"] for v in per_exec.values())
    # the closes reached the proxy (they need the token): closing again is a duplicate there
    for r in [*results, timed_out]:
        again = httpx.post(
            f"{cluster.url}/tidal/executions/{r.execution_id}/close", headers=cluster.admin, json={}
        ).json()
        assert again["duplicate"] and again["reason"] == r.outcome.reason, again


def test_the_quickstart_runs_through_agent_kind_run(cluster, tmp_path, monkeypatch):
    """``configs/quickstart.yaml`` (what ``make demo`` runs): every execution is one
    ``ChatKind.run`` (the road a user's task takes), whose ``Outcome`` the pool returns."""
    cfg = load_yaml(ROOT / "configs" / "quickstart.yaml")
    workload = Workload(cfg)
    assert isinstance(workload.agent, ChatKind) and workload.builtin
    ran, real = [], ChatKind.run

    async def spy(self, ctx):
        out = await real(self, ctx)
        ran.append((ctx.execution_id, out))
        return out

    monkeypatch.setattr(ChatKind, "run", spy)
    rt = cfg.runtime
    pool = HarnessPool(
        PoolConfig(
            proxy_url=cluster.url,
            max_turns=cfg.task.max_turns,
            max_tokens_per_turn=rt.max_tokens,
            temperature=rt.temperature,
            timeout_s=60.0,
            token=cluster.token,
        ),
        tmp_path,
    )
    job = workload.job(0, 0, seed=11)
    assert job.row.messages[0]["content"].startswith("You are a file agent.")
    results = asyncio.run(pool.run([("b0-g0", job)] * 4, [f"b0-g0-e{k}" for k in range(4)]))
    assert sorted(eid for eid, _ in ran) == [r.execution_id for r in results]
    by_id = dict(ran)
    for r in results:
        assert r.outcome.reason == CloseReason.COMPLETED
        assert r.outcome.transcript == by_id[r.execution_id].transcript
        assert 1 <= r.outcome.turns <= cfg.task.max_turns and r.outcome.reward is not None
        # each call counted to its execution by the execution's own URL and key (no header,
        # no run token): the proxy holds one record per turn
        calls = httpx.get(
            f"{cluster.url}/tidal/executions/{r.execution_id}/records", headers=cluster.admin
        ).json()["calls"]
        assert len(calls) == r.outcome.turns
