"""The harness pool drives multi-turn workspace tasks and single-turn arithmetic tasks through
the proxy and real engines; a slow one times out and is closed with reason ``timeout``."""

from __future__ import annotations

import asyncio
import random

import httpx

from tidal.agents import ArithmeticTask, EventLog, HarnessPool, PoolConfig, WorkspaceTask
from tidal.agents.environments import ToolLatency


def test_pool_runs_executions_and_times_out_slow_ones(cluster, tmp_path):
    events = EventLog()
    pool = HarnessPool(PoolConfig(proxy_url=cluster.url, max_turns=3, max_tokens_per_turn=16,
                                  timeout_s=20.0, token=cluster.token), tmp_path, events)
    fast = ToolLatency(random.Random(0), median_s=0.005, cap_s=0.05)
    tasks = [("ws", lambda i=i: WorkspaceTask(i, fast)) for i in range(6)]
    tasks += [("math", lambda i=i: ArithmeticTask(i)) for i in range(6)]
    results = asyncio.run(pool.run(tasks))
    assert [r.reason for r in results] == ["completed"] * 12
    for r in results[:6]:
        assert 1 <= r.turns <= 3 and (r.workspace / "data0.txt").is_file()
    assert all(r.turns == 1 for r in results[6:])

    slow_pool = HarnessPool(PoolConfig(proxy_url=cluster.url, max_turns=50, timeout_s=0.5,
                                       token=cluster.token), tmp_path, events)
    slow = ToolLatency(random.Random(1), median_s=2.0, sigma=0.1, cap_s=5.0)
    (timed_out,) = asyncio.run(slow_pool.run([("slow", lambda: WorkspaceTask(99, slow))]))
    assert timed_out.reason == "timeout" and timed_out.reward == 0.0
    closed = [e for e in events.events if e[0] == "closed"]
    assert len(closed) == 13 and closed[-1][3] == "timeout"
    per_exec = {}
    for e in events.events:
        per_exec.setdefault(e[1], []).append(e[0])
    assert all(v == ["dispatched", "launched", "closed"] for v in per_exec.values())
    # the closes reached the proxy (they need the token): closing again is a duplicate there
    for r in [*results, timed_out]:
        again = httpx.post(f"{cluster.url}/tidal/executions/{r.execution_id}/close",
                           headers=cluster.admin, json={}).json()
        assert again["duplicate"], again
