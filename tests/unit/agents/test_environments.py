from __future__ import annotations

import asyncio
import random

import pytest

from tidal.agents import ArithmeticTask, EventLog, ExecutionRegistry, WorkspaceTask
from tidal.agents.environments import ToolLatency
from tidal.errors import LedgerError


def _fast(seed):
    return WorkspaceTask(seed, ToolLatency(random.Random(seed), median_s=0.001, cap_s=0.01))


def test_workspace_task_is_solvable_by_tool_calls(tmp_path):
    async def main():
        env = _fast(1)
        obs = await env.reset(tmp_path / "ws")
        assert "data0.txt" in obs
        listing = await env.step("ls")
        assert "data1.txt" in listing.observation and not listing.done
        a = int((await env.step("read data0.txt")).observation)
        b = int((await env.step("read data1.txt")).observation)
        wrong = await env.step(f"write answer.txt {a + b + 1}\ndone")
        assert wrong.done and wrong.reward == 0.2
        right = await env.step(f"write answer.txt {a + b}\ndone")
        assert right.done and right.reward == 1.0
        escape = await env.step("read ../../etc/passwd")
        assert "no such file" in escape.observation

    asyncio.run(main())


def test_tool_latency_is_long_tailed_and_seeded():
    lat = ToolLatency(random.Random(0), median_s=0.3, sigma=1.5, cap_s=1e9)
    draws = sorted(lat.median_s * lat.rng.lognormvariate(0, lat.sigma) for _ in range(2000))
    assert 0.2 < draws[1000] < 0.45 and draws[1980] > 10 * draws[1000]


def test_arithmetic_task_checks_the_sum(tmp_path):
    async def main():
        env = ArithmeticTask(3)
        q = await env.reset(tmp_path)
        assert (await env.step(str(env.a + env.b))).reward == 1.0
        assert (await env.step("no idea")).reward == 0.0
        return q

    assert "plus" in asyncio.run(main())


def test_registry_closes_exactly_once_and_emits_events():
    log = EventLog()
    reg = ExecutionRegistry(log)
    st = reg.dispatch("g1")
    assert reg.close(st.execution_id, "timeout", 0.2)
    assert not reg.close(st.execution_id, "completed", 1.0) and reg.duplicate_closes == 1
    kinds = [e[0] for e in log.events]
    assert kinds == ["dispatched", "launched", "closed"]
    assert log.events[-1][3:] == ("timeout", 0.2)
    with pytest.raises(LedgerError):
        reg.close("nope")
    with pytest.raises(LedgerError):
        reg.close(st.execution_id, "exploded")
