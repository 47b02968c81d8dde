"""What isolating agents costs: a command agent's execution (the program ``true``) in a process
group only, in a PID namespace, and (as root) as ``tidal-agent`` with the run directory hidden;
and a worker process of the user's Python code (its start, its memory, a call's round trip).

    .venv/bin/python benchmarks/agent_sandbox.py      # about 20 s
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from tidal.agents.kinds import AgentContext, build_agent
from tidal.agents.python_workers import _PROCS
from tidal.agents.rewards import Reward
from tidal.agents.sandbox import Sandbox
from tidal.agents.tasks import TaskRow
from tidal.config import AgentConfig, RewardConfig
from tidal.contracts.executions import Outcome

N = 40


def _ctx(top: Path, name: str) -> AgentContext:
    ws = top / "run" / "workspaces" / name
    ws.mkdir(parents=True)
    return AgentContext(
        name,
        "g",
        TaskRow(0, prompt="p"),
        ws,
        "http://127.0.0.1:9/x/e/v1",
        "k",
        "http://127.0.0.1:9",
        "m",
        20.0,
        8,
        1,
        1.0,
        0,
    )


def commands(top: Path) -> None:
    modes = ["group", "namespace"] + (["user"] if os.geteuid() == 0 else [])
    for mode in modes:
        agent = build_agent(AgentConfig(kind="command", command=["true"]))
        if mode != "user":
            agent.sandbox = Sandbox(mode)

        async def go(agent=agent, mode=mode):
            for i in range(N):
                await agent.run(_ctx(top, f"{mode}-{i}"))

        t0 = time.monotonic()
        asyncio.run(go())
        print(
            f"command agent 'true', sandbox {mode!r}: "
            f"{1000 * (time.monotonic() - t0) / N:.0f} ms per execution"
        )


def workers() -> None:
    reward = Reward(RewardConfig(builtin="exact"))
    row, out = TaskRow(0, prompt="p", answer="a"), Outcome(answer="a")

    async def go():
        t0 = time.monotonic()
        await reward.score(row, out, Path("."))
        start = time.monotonic() - t0
        rss = [
            int(Path(f"/proc/{p}/status").read_text().split("VmRSS:")[1].split()[0]) for p in _PROCS
        ]
        t1 = time.monotonic()
        for _ in range(200):
            await reward.score(row, out, Path("."))
        per_call = (time.monotonic() - t1) / 200
        print(
            f"python worker: first call (its start) {start:.2f} s, RSS {max(rss) // 1024} MB, "
            f"{1000 * per_call:.1f} ms per call after"
        )

    asyncio.run(go())


if __name__ == "__main__":
    top = Path(tempfile.mkdtemp(prefix="tidal-bench-", dir="/tmp"))
    top.chmod(0o755)
    try:
        commands(top)
        workers()
    finally:
        shutil.rmtree(top, ignore_errors=True)
