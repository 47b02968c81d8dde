"""The user's Python code runs in worker processes, never in the driver's loop: a python agent
that swallows cancellation, or blocks with ``time.sleep`` in an ``async def``, closes at its
timeout and never freezes the driver; one that returns NaN closes ``reward_error``; a reward
that never returns is killed at its timeout, and SIGTERM still ends the process at once."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tidal.agents.kinds import AgentContext, build_agent
from tidal.agents.python_workers import CANCEL_GRACE_S
from tidal.agents.rewards import Reward, RewardError
from tidal.agents.tasks import TaskRow
from tidal.agents.workload import AgentJob, run_job
from tidal.config import AgentConfig, RewardConfig
from tidal.contracts.executions import Outcome, Turn

AGENTS = """\
import asyncio, time

async def swallows(row):
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass

async def sleeps(row):
    time.sleep(30)
    return 1.0

async def nan(row):
    return float("nan")

async def fine(row, ctx):
    return {"reward": 0.5, "answer": ctx.execution_id,
            "transcript": [{"action": "a", "observation": "o", "tool": "x", "call_s": 0.5}]}
"""


EXACT = Reward(RewardConfig(builtin="exact"))


def _ctx(ws: Path, timeout_s: float) -> AgentContext:
    return AgentContext(
        "b0-g0-e0",
        "b0-g0",
        TaskRow(0, prompt="p"),
        ws,
        "http://127.0.0.1:9/x/b0-g0-e0/v1",
        "tx-key",
        "http://127.0.0.1:9",
        "m",
        timeout_s,
        8,
        1,
        1.0,
        0,
    )


def _agent(tmp_path: Path, name: str):
    (tmp_path / "agents_q.py").write_text(AGENTS)
    return build_agent(AgentConfig(kind="python", function=f"{tmp_path / 'agents_q.py'}:{name}"))


async def _timed(job: AgentJob, ctx: AgentContext) -> tuple[object, float, float]:
    """The job's result, the longest the driver's loop went without running (a 50 ms ticker),
    and the job's seconds."""
    beats = [time.monotonic()]

    async def tick():
        while True:
            await asyncio.sleep(0.05)
            beats.append(time.monotonic())

    ticker = asyncio.ensure_future(tick())
    t0 = time.monotonic()
    done = await run_job(job, ctx)
    ticker.cancel()
    beats.append(time.monotonic())
    gap = max(b - a for a, b in itertools.pairwise(beats))
    return done, gap, time.monotonic() - t0


def test_an_agent_that_swallows_cancellation_closes_at_its_timeout(tmp_path):
    job = AgentJob(TaskRow(0, prompt="p"), _agent(tmp_path, "swallows"), EXACT, 0, {})
    done, gap, took = asyncio.run(_timed(job, _ctx(tmp_path / "ws", 1.0)))
    assert done.reason == "timeout"
    assert took < 1.0 + CANCEL_GRACE_S + 10  # the timeout, the grace, slack (a loaded host)
    assert gap < 1.0  # the driver's loop ran all along


def test_time_sleep_in_an_async_agent_never_freezes_the_driver(tmp_path):
    job = AgentJob(TaskRow(0, prompt="p"), _agent(tmp_path, "sleeps"), EXACT, 0, {})
    done, gap, took = asyncio.run(_timed(job, _ctx(tmp_path / "ws", 2.0)))
    assert done.reason == "timeout" and took < 2.0 + CANCEL_GRACE_S + 10
    assert gap < 1.0, gap  # never frozen for the agent's 30 s sleep


def test_a_nan_reward_from_an_agent_closes_reward_error(tmp_path):
    out = asyncio.run(_agent(tmp_path, "nan").run(_ctx(tmp_path / "ws", 20.0)))
    assert out.reason == "reward_error" and out.reward is None
    assert out.detail == "the agent returned a reward is nan, not finite"


def test_an_agent_gets_its_context_and_its_answer_comes_back(tmp_path):
    out = asyncio.run(_agent(tmp_path, "fine").run(_ctx(tmp_path / "ws", 20.0)))
    assert out.reason == "completed" and out.reward == 0.5 and out.answer == "b0-g0-e0"
    # checked as an Outcome: its transcript as Turns (what a Turn does not hold is left out)
    assert out.transcript == [Turn(action="a", observation="o", call_s=0.5)]


def test_a_reward_that_never_returns_is_killed_and_leaves_no_thread(tmp_path):
    (tmp_path / "hang_q.py").write_text("import time\ndef score(answer):\n    time.sleep(600)\n")
    reward = Reward(RewardConfig(function=f"{tmp_path / 'hang_q.py'}:score", timeout_s=1.0))
    # threads earlier tests of this process left (a run's pools, in the full suite) are not its
    before = set(threading.enumerate())
    t0 = time.monotonic()

    async def scored():
        try:
            await reward.score(TaskRow(0), Outcome(answer="a"), tmp_path)
        except RewardError as exc:
            return str(exc)
        return "scored"

    assert asyncio.run(scored()) == "no reward within 1 s (task.reward.timeout_s)"
    assert time.monotonic() - t0 < 1.0 + CANCEL_GRACE_S + 10
    held = [
        t.name
        for t in threading.enumerate()
        if not t.daemon and t is not threading.main_thread() and t not in before
    ]
    assert not held, held


DRIVER = """\
import asyncio, signal, sys
from pathlib import Path
from tidal.contracts.executions import Outcome, Turn
from tidal.agents.python_workers import _PROCS
from tidal.agents.rewards import Reward
from tidal.agents.tasks import TaskRow
from tidal.config import RewardConfig

def stop(*_):
    raise SystemExit(130)

signal.signal(signal.SIGTERM, stop)
reward = Reward(RewardConfig(function=sys.argv[1], timeout_s=600))

async def main():
    task = asyncio.ensure_future(reward.score(TaskRow(0), Outcome(answer="a"), Path(".")))
    while not _PROCS:
        await asyncio.sleep(0.05)
    print(*_PROCS, flush=True)
    await task

asyncio.run(main())
"""


def test_sigterm_ends_a_driver_waiting_on_a_hung_reward(tmp_path):
    (tmp_path / "hang_q.py").write_text("import time\ndef score(answer):\n    time.sleep(600)\n")
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), f"{tmp_path / 'hang_q.py'}:score"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        time.sleep(1.0)  # the reward is running in its worker
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 130
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers and not any(_alive(p) for p in workers), "a worker outlived its driver"


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_no_worker_outlives_close_all(tmp_path):
    from tidal.agents.python_workers import _PROCS, close_all

    asyncio.run(_agent(tmp_path, "fine").run(_ctx(tmp_path / "ws", 20.0)))
    pids = list(_PROCS)
    close_all()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    assert os.getpid() not in pids


def test_concurrent_calls_share_at_most_the_pools_workers(tmp_path):
    from tidal.agents.python_workers import _PROCS, close_all

    close_all()
    agent = _agent(tmp_path, "fine")

    async def many():
        outs = await asyncio.gather(*[agent.run(_ctx(tmp_path / "ws", 20.0)) for _ in range(30)])
        return outs, len(_PROCS)

    outs, workers = asyncio.run(many())
    assert [o.reward for o in outs] == [0.5] * 30
    assert 1 <= workers <= 2  # task.agent.workers (default 2), not one per call
    assert not _PROCS  # the loop's end closed them
